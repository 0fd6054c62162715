"""Speculative decoding: proposers (n-gram prompt lookup, draft model), exact verification by
rejection sampling, and the controller that turns speculation off when it does not pay."""
