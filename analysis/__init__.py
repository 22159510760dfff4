"""Reports, tables and figures built on posteriorzoo (the paper's tables and plots).

Empty for now: the MMD report tables and the paper's figures arrive with the
canonicalizer and the MMD engine.
"""
