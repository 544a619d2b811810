"""The table locations (engram/config/table_locations.py) are stated once: which optimizers each
location supports is read by the config, the optimizer builder and the table sharding, and the
row-store room has exactly one backend per location."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from engram.config import ConfigError, config_from_dict
from engram.config.table_locations import TABLE_LOCATION_SPECS, TABLE_LOCATIONS
from engram.optim.builder import build_table_optimizer
from engram.rowstore.host_worker import mark_host_resident, table_location_of


def test_every_location_has_a_row_store():
    from parallelisms.engram_tables.sharding import LOCATION_BACKENDS

    assert tuple(LOCATION_BACKENDS) == TABLE_LOCATIONS
    assert TABLE_LOCATION_SPECS["host"].optimizers() == ("lazy_adam", "rowwise_adagrad")
    assert TABLE_LOCATION_SPECS["device"].optimizers() == ("adam", "lazy_adam", "rowwise_adagrad")


def _adam(param: nn.Parameter):
    return build_table_optimizer("adam", [{"params": [param], "lr": 1e-3}], (0.9, 0.99), 1e-8)


def test_one_rule_for_config_builder_and_sharding(monkeypatch):
    """Refused by all three from the one table; allowed by all three once the table allows it."""
    param = nn.Parameter(torch.zeros(4, 2))
    mark_host_resident(param)
    assert table_location_of(param) == "host"
    with pytest.raises(ConfigError, match="lazy_adam or rowwise_adagrad"):
        config_from_dict({"engram": {"table_location": "host"}})
    with pytest.raises(ValueError, match="lazy_adam or rowwise_adagrad"):
        _adam(param)
    allowed = dataclasses.replace(TABLE_LOCATION_SPECS["host"], row_sparse_only=False)
    monkeypatch.setitem(TABLE_LOCATION_SPECS, "host", allowed)
    config_from_dict({"engram": {"table_location": "host"}})
    _adam(param)


def test_sharding_reads_the_rule(monkeypatch):
    """apply_engram_table_sharding refuses a dense-gradient host table by the table's rule (it
    refuses before touching the mesh, so a stand-in mesh suffices)."""
    from parallelisms.engram_tables import apply_engram_table_sharding

    with pytest.raises(ValueError, match="lazy_adam or rowwise_adagrad"):
        apply_engram_table_sharding(nn.Linear(2, 2), None, grad_scale=1.0, location="host")
    allowed = dataclasses.replace(TABLE_LOCATION_SPECS["host"], row_sparse_only=False)
    monkeypatch.setitem(TABLE_LOCATION_SPECS, "host", allowed)
    with pytest.raises(AttributeError):  # past the rule: the stand-in mesh has no ndim
        apply_engram_table_sharding(nn.Linear(2, 2), None, grad_scale=1.0, location="host")
