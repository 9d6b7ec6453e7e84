"""A compressor, algorithm, strategy or workload name written in another case or with ``-`` for ``_``
(``TopK``, ``QSGD``, ``DiLoCo``, ``streaming_diloco``, ``dgc-threshold``, ``Ring``, ``MNIST1D-CNN``: how
papers and other libraries spell them) is refused with the registered spelling in the message: ``unknown compressor 'TopK' (did you mean 'topk'?); allowed:
...``. Before, the message listed every name and left the reader to find it. No worker; about 10 s (imports)."""
from __future__ import annotations

import pytest

import gradpress
import gradpress.algorithms as algorithms
from gradpress import workloads
from gradpress.cli import main as cli
from gradpress.compress import names as compressor_names
from gradpress.exchange import available as strategy_names
from gradpress.exchange.base import parse_strategy


def other_spellings(name: str) -> list[str]:
    """Upper case, title case of each word, and ``_``/``-`` swapped: spellings that are not ``name``."""
    swapped = name.translate(str.maketrans("_-", "-_"))
    words = [w.capitalize() for w in name.replace("-", "_").split("_")]
    candidates = {name.upper(), swapped, swapped.upper(), "_".join(words), "-".join(words)}
    return sorted(c for c in candidates if c != name)


#: kind -> (its registered names, the parser that refuses an unknown one)
PARSERS = {"compressor": (compressor_names, gradpress.compressor), "algorithm": (algorithms.names, algorithms.parse),
           "strategy": (strategy_names, parse_strategy), "workload": (workloads.names, workloads.get)}


@pytest.mark.parametrize(("kind", "name"), [(kind, name) for kind, (names, _) in PARSERS.items() for name in names()])
def test_a_name_spelled_another_way_is_named(kind: str, name: str) -> None:
    parse = PARSERS[kind][1]
    for spelling in other_spellings(name):
        with pytest.raises(ValueError) as exc:
            parse(spelling)
        assert f"unknown {kind} {spelling!r} (did you mean {name!r}?); allowed: " in str(exc.value), str(exc.value)


def test_the_train_command_names_them_too(capsys, tmp_path) -> None:  # noqa: ANN001
    """``gradpress train`` checks the algorithm before the registry does (``ddp`` is not in it)."""
    for flag, spelling, name in (("--algorithm", "streaming_diloco", "streaming-diloco"),
                                 ("--algorithm", "DDP", "ddp"), ("--compressor", "dgc-threshold", "dgc_threshold"),
                                 ("--workload", "MNIST1D-CNN", "mnist1d-cnn"), ("--strategy", "Ring", "ring")):
        assert cli(["train", flag, spelling, "--steps", "1", "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert f"{spelling!r} (did you mean {name!r}?); allowed: " in err, err


def test_a_name_with_no_other_spelling_gets_no_guess() -> None:
    for make, spec in ((gradpress.compressor, "topq"), (algorithms.parse, "dilocco")):
        with pytest.raises(ValueError) as exc:
            make(spec)
        assert "did you mean" not in str(exc.value) and f"{spec!r}; allowed: " in str(exc.value), str(exc.value)
