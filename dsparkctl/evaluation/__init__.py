"""Acceptance evaluation: teacher-forced analytic β (fast) and live speculative rollouts."""
