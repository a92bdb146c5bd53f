"""prescient.latency_bench"""
