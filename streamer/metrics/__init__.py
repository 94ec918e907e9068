"""Windowed metrics of the trajectory stream: pure aggregation (`windows`), used by the faust app."""
