"""Discrete-event cluster simulator, reports and plots."""
