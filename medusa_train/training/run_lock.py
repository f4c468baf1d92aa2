"""Training's import path of the run lock, which lives in :mod:`medusa_train.run_lock` (every command uses it)."""

from __future__ import annotations

from medusa_train.run_lock import LOCK_FILE, Holder, LockHeldError, RunLock, check_token, lock_path, read_holder

__all__ = ["LOCK_FILE", "Holder", "LockHeldError", "RunLock", "check_token", "lock_path", "read_holder"]
