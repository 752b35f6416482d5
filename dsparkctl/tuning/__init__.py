"""Tuning the scheduler offline from recorded rounds: STS calibration and the policy sweep."""
