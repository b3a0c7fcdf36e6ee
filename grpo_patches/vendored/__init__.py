"""Trainers vendored into the kit: compact reference implementations the patches also apply to."""
