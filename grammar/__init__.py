"""prescient.grammar"""
