"""prescient.speculative"""
