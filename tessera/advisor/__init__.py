"""Workload profiler, optimization advisor and autopilot.

trace.py: the JSONL trace format, the server's recorder and synthetic generators; sim.py: the
step cost model and the scheduler simulation; profile.py: the six measurements; advise.py: the
decision tree and the configuration file; report.py: the markdown report; autopilot.py: the
run-time controller `tessera serve --autopilot` consults between steps.
"""
