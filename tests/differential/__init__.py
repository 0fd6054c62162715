"""The differential fuzzer: random workloads under random feature sets, every request's output
compared with the same request run alone on the plain engine (see fuzz.py; run it with
`python -m tests.differential --cases 2000`)."""
