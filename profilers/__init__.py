"""Measurements on the target devices and process group that `planner profile` turns into a profile."""

from __future__ import annotations

from profilers.session import ProfileConfig, profile_worker, run_profile

__all__ = ["ProfileConfig", "profile_worker", "run_profile"]
