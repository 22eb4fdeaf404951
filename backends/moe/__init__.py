"""MoE around `grouped_matmul`: token dispatch and combine on one rank (dispatch.py), and across
the ranks of an expert-parallel group (expert_parallel.py, SPEC 11.1)."""
