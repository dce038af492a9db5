"""Autoscaler: pure decision logic plus actuators."""
