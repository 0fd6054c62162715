"""tessera.native.clear_stale_lock: a build killed mid-way must not make the next start wait forever."""

from __future__ import annotations

import os
import time

from tessera import native


def test_an_old_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    assert not native.clear_stale_lock(tmp_path)  # no lock: nothing to do
    lock.write_text("")
    assert not native.clear_stale_lock(tmp_path, max_age_s=600)  # a build may be running now
    assert lock.exists()
    old = time.time() - 601
    os.utime(lock, (old, old))
    assert native.clear_stale_lock(tmp_path, max_age_s=600)  # left by a killed build
    assert not lock.exists()
