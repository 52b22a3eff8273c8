"""The diagnostic switches: parsed once from the environment, changed for a block with `override`."""

from __future__ import annotations

import pytest
from ft_transformers.kernels.options import Options, options, override


def test_defaults_when_nothing_is_set():
    o = Options.from_env({})
    assert o.direct_launch and o.gemm_tune and o.siblings
    assert o.efta_two_launch
    assert (o.efta_config, o.efta_split, o.efta_fold, o.gemm_config, o.gemm_split) == (None,) * 5
    assert (o.gemm_tma, o.gemm_persistent, o.gemm_xvar) == (None,) * 3


def test_variables_parse_into_fields():
    o = Options.from_env({"FTT_EFTA_CONFIG": "64,64,4,3", "FTT_ABFT_GEMM_CONFIG": "128, 128, 64, 8, 3",
                          "FTT_EFTA_SPLIT": "4", "FTT_EFTA_FOLD": "0", "FTT_ABFT_GEMM_TMA": "1",
                          "FTT_ABFT_GEMM_PERSISTENT": "auto", "FTT_SIBLINGS": "0", "FTT_DIRECT_LAUNCH": "0",
                          "FTT_GEMM_XVAR": "1"})
    assert o.efta_config == (64, 64, 4, 3) and o.gemm_config == (128, 128, 64, 8, 3)
    assert o.efta_split == 4 and o.efta_fold is False and o.gemm_tma is True and o.gemm_persistent is None
    assert not o.siblings and not o.direct_launch
    assert o.gemm_xvar is True and Options.from_env({"FTT_GEMM_XVAR": "0"}).gemm_xvar is False
    assert Options.from_env({"FTT_ABFT_GEMM_FUSED": "0"}).gemm_fused is False and o.gemm_fused is None


@pytest.mark.parametrize("env", [{"FTT_EFTA_CONFIG": "64,64,4"}, {"FTT_ABFT_GEMM_CONFIG": "a,b,c,d,e"},
                                 {"FTT_EFTA_SPLIT": "0"}, {"FTT_ABFT_GEMM_SPLIT": "x"}, {"FTT_EFTA_FOLD": "2"},
                                 {"FTT_ABFT_GEMM_PERSISTENT": "yes"}, {"FTT_GEMM_XVAR": "on"}])
def test_bad_values_raise_naming_the_variable(env):
    with pytest.raises(ValueError, match=next(iter(env))):
        Options.from_env(env)


def test_bad_override_raises_and_keeps_the_settings():
    before = options()
    with pytest.raises(ValueError, match="gemm_split"), override(gemm_split=0):
        pass
    with pytest.raises(ValueError, match="efta_config"), override(efta_config=(64, 64)):
        pass
    assert options() is before


def test_override_restores_and_interns():
    before = options()
    with override(gemm_tune=not before.gemm_tune, efta_split=3) as inner:
        assert options() is inner and inner.efta_split == 3
        with override(efta_split=None) as nested:
            assert nested.efta_split is None and nested.gemm_tune is inner.gemm_tune
        assert options() is inner
    assert options() is before
    # equal settings are one object: caches keyed on it hit again when a block repeats or ends
    with override(efta_split=3, gemm_tune=not before.gemm_tune) as again:
        assert again is inner
    with override(efta_split=before.efta_split) as same:
        assert same is before
