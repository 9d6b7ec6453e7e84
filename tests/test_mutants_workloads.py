"""Contracts of the built-in workloads (``gradpress/workloads/{base, mnist1d,
wide, digits, charlm, userdata}.py``) that the other workload tests do not
pin. Written for survivors of ``make mutants`` (``workloads`` group)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.mutants
