"""Benchmarks of alignpipe's trainers side by side with TRL's (test/bench extra only)."""
