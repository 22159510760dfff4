"""Weight-space symmetries (permutations, ReLU scalings, softmax shift, min-mass).

Not implemented yet: the canonicalizer is the next piece of work.
"""
