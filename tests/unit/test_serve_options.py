"""`pdserve serve`'s flags reach the config the engines are built from, with the config's
own validation (cluster/serve_options.py)."""

import pytest

from cluster.cli import build_parser
from cluster.serve_main import config_from_args


def config_of(*flags: str):
    return config_from_args(build_parser().parse_args(["serve", *flags]))


def test_scheduler_flags_reach_every_tier_engine():
    config = config_of("--max-num-batched-tokens", "512", "--max-step-slowdown", "1.5")
    for tier in (config.prefill, config.decode):
        scheduler = config.engine_for(tier).scheduler
        assert (scheduler.max_num_batched_tokens, scheduler.max_step_slowdown) == (512, 1.5)
    defaults = config_of().engine.scheduler
    assert (defaults.max_num_batched_tokens, defaults.max_step_slowdown) == (2048, 2.0)


def test_a_step_slowdown_below_one_is_refused():
    with pytest.raises(ValueError, match="max_step_slowdown"):
        config_of("--max-step-slowdown", "0.5")
