"""Run storage and analysis: the tap that records a run's topics, its tables and summary, adaptation
(recovery, forgetting), and `sao record`.
"""
