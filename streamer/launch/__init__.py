"""Orchestration: the `sao` command, `sao up` (resource plan, roles as processes or Ray actors).
"""
