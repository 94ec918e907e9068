"""The metrics role: a faust app that aggregates trajectories and learner events into windows.
"""
