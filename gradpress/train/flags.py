"""A training option's error as the command line's user reads it: the flag
(``--error-feedback``) where :func:`~gradpress.train.config.make_config`
names the field (``error_feedback``), for the fields given as flags only (a
``--config`` TOML file's keys and the Python API's keywords are field names,
and keep them)."""

from __future__ import annotations

import argparse
import functools
import re
from collections.abc import Collection

__all__ = ["flag_of", "name_flags"]

# "lr must be ...", "plan_costs is used by ...", "hidden sets ...", "out: ..." : the field is the subject
_SUBJECT = re.compile(r"([a-z_]+)(?= must | sets | is used |: )")


@functools.cache
def _flags() -> dict[str, str]:
    from gradpress.train.args import add_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return {a.dest: max(a.option_strings, key=len) for a in parser._actions if a.option_strings}


def flag_of(field: str) -> str:
    """The ``gradpress train`` flag that sets ``field`` (``batch_size`` -> ``--batch-size``,
    ``progress`` -> ``--no-progress``); ``field`` itself when no flag sets it."""
    return _flags().get(field, field)


def name_flags(message: str, given: Collection[str]) -> str:
    """``message`` (a validation error) with the field it starts with written as its flag, when that field is
    one of ``given`` (the fields the command line set): ``error_feedback must be one of on, off, auto, got
    'yes'`` -> ``--error-feedback must be ...``, ``out: ...`` -> ``--out: ...``. A message that names what it
    is about, and the value, another way is kept (``unknown workload 'x'``, ``strategy 'ring' takes no
    parameters``, ``split 'x': ...``, ``config file 'x' ...``)."""
    m = _SUBJECT.match(message)
    if m and m.group(1) in given and m.group(1) in _flags():
        return flag_of(m.group(1)) + message[m.end(1):]
    return message
