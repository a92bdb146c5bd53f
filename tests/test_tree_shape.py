"""The tests folder mirrors the packages: no two test files share a basename (pytest's rootdir
imports would shadow one with the other, and a reader looking for "the admission test" finds
one), and every test file sits in the folder of the package it tests or in a cross-cutting one
(reliability, the layering test here)."""

from __future__ import annotations

import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
FOLDERS = {"runtime", "speculative", "kernels", "grammar", "server", "latency_bench", "reliability"}


def test_no_two_test_files_share_a_basename():
    names = collections.Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, k in names.items() if k > 1]


def test_every_test_file_is_under_a_package_folder():
    stray = [str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
             if p.parent != TESTS and p.relative_to(TESTS).parts[0] not in FOLDERS]
    assert not stray
