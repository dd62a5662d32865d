"""decodelab.course.pictures: the engine map is built from PARTS and EngineHooks (every part on
it, a notebook's own highlighted, a new part or hook shows up by itself), and each flow picture
draws a real object's state (it changes when the state does) and refuses bad input."""

from __future__ import annotations

import dataclasses
import xml.etree.ElementTree as ET

import pytest
import torch

from decodelab import course
from decodelab.course import pictures
from decodelab.course.progress import PARTS
from decodelab.course.svg import find_by_class
from decodelab.decoding import speculative
from decodelab.decoding.generate import stream_token_ids
from decodelab.engine import llm as engine_llm
from decodelab.engine.block_allocator import BlockAllocator
from decodelab.model.kv_cache import KVCache
from decodelab.model.registry import load
from decodelab.model.toy import tiny_model, toy_config
from decodelab.params import SamplingParams


def parts_of(svg: str, cls: str = "part") -> set[tuple[str, str]]:
    return {(e.get("data-notebook"), e.get("data-exercise")) for e in find_by_class(svg, cls)}


def classes(svg: str, cls: str) -> list[ET.Element]:
    return find_by_class(svg, cls)


# ------------------------------------------------------------------------------ the engine map
def test_every_part_is_on_the_map_once_and_the_svg_parses():
    svg = pictures.engine_map().svg
    ET.fromstring(svg)
    chips = find_by_class(svg, "part")
    assert len(chips) == len(PARTS)
    assert parts_of(svg) == set(PARTS)
    assert not find_by_class(svg, "highlight")
    assert pictures.engine_map()._repr_svg_() == svg
    assert repr(pictures.engine_map()).startswith("Picture('The engine, in serving order'")


@pytest.mark.parametrize("notebook", sorted({nb for nb, _ in PARTS}))
def test_the_highlight_is_exactly_the_notebooks_parts(notebook):
    svg = pictures.engine_map(notebook).svg
    assert parts_of(svg, "highlight") - {(None, None)} == {key for key in PARTS if key[0] == notebook}
    lit_stages = {e.get("data-stage") for e in find_by_class(svg, "stage") if "highlight" in e.get("class")}
    assert lit_stages == {e.get("data-stage") for e in find_by_class(svg, "part") if "highlight" in e.get("class")}


def test_stages_come_in_serving_order_and_name_every_hook():
    svg = pictures.engine_map().svg
    order = [e.get("data-stage") for e in find_by_class(svg, "stage")]
    pipeline = [
        "request",
        "tokenizer",
        "scheduler",
        "paged_kv",
        "forward",
        "attention",
        "linear",
        "sampling",
        "speculative",
        "stream",
    ]
    assert [stage for stage in order if stage in pipeline] == pipeline
    hooks = {e.get("data-hook") for e in find_by_class(svg, "stage")}
    assert {f.name for f in dataclasses.fields(engine_llm.EngineHooks)} <= hooks


def test_every_part_has_a_stage_today_and_the_code_named_exists():
    unplaced = [part for part in PARTS.values() if pictures.place_part(part) == "other"]
    assert not unplaced, f"add words for {unplaced} to pictures.PLACES"
    for stage in pictures.stages():
        for name in stage.code:
            assert pictures.code_exists(name), f"stage {stage.key} names {name}, which the library lacks"


def test_a_new_notebook_and_a_new_hook_appear_by_themselves(monkeypatch):
    monkeypatch.setitem(PARTS, ("12_disaggregation", "hand_off"), "disaggregation: hand-off between machines")
    hooks = dataclasses.make_dataclass(
        "EngineHooks",
        [(f.name, f.type, f) for f in dataclasses.fields(engine_llm.EngineHooks)]
        + [("detokenize", object, dataclasses.field(default=None))],
    )
    monkeypatch.setattr(engine_llm, "EngineHooks", hooks)
    svg = pictures.engine_map("12_disaggregation").svg
    assert parts_of(svg, "highlight") - {(None, None)} == {("12_disaggregation", "hand_off")}
    assert {e.get("data-stage") for e in find_by_class(svg, "part") if "highlight" in e.get("class")} == {"other"}
    assert "detokenize" in {e.get("data-hook") for e in find_by_class(svg, "stage")}


def test_an_unknown_notebook_is_a_clear_error():
    with pytest.raises(ValueError, match="03_kv_cache"):
        pictures.engine_map("03_kv_cahce")
    assert course.engine_map is pictures.engine_map


# ------------------------------------------------------------------------------ the KV cache
def test_kv_cache_flow_marks_the_rows_just_appended():
    model = tiny_model(seed=0)
    cache = KVCache(model.config, 1, 16)
    with torch.inference_mode():
        model(torch.tensor([[3, 1, 4, 1, 5]]), kv_cache=cache)  # prefill: 5 rows per layer
        model(torch.tensor([[9]]), kv_cache=cache)  # one decode step: 1 more
    svg = pictures.kv_cache_flow(cache, previous_length=5).svg
    for layer in range(model.config.num_hidden_layers):
        new = [e for e in find_by_class(svg, "new") if e.get("data-layer") == str(layer)]
        held = [e for e in find_by_class(svg, "held") if e.get("data-layer") == str(layer)]
        assert [int(e.get("data-position")) for e in new] == [5]
        assert len(held) == 5
    with torch.inference_mode():
        model(torch.tensor([[2, 6, 5]]), kv_cache=cache)
    after = pictures.kv_cache_flow(cache, previous_length=6).svg
    assert after != svg
    assert len(find_by_class(after, "new")) == 3 * model.config.num_hidden_layers
    cache.truncate(4)
    assert not find_by_class(pictures.kv_cache_flow(cache, previous_length=4).svg, "new")
    with pytest.raises(ValueError, match="previous_length"):
        pictures.kv_cache_flow(cache, previous_length=5)


def test_kv_cache_flow_of_a_long_deep_cache_draws_a_window():
    config = toy_config(num_hidden_layers=6)
    cache = KVCache(config, 1, 128)
    for layer in range(6):
        cache.append(layer, torch.zeros(1, 2, 100, config.head_dim), torch.zeros(1, 2, 100, config.head_dim))
    svg = pictures.kv_cache_flow(cache).svg
    drawn = {int(e.get("data-layer")) for e in find_by_class(svg, "slot")}
    assert drawn == {0, 1, 2, 5}  # the first three layers and the last
    positions = [int(e.get("data-position")) for e in find_by_class(svg, "slot") if e.get("data-layer") == "0"]
    assert len(positions) == 60 and positions[-1] == 103  # the last 60 up to 4 past the held rows
    assert [int(e.get("data-position")) for e in find_by_class(svg, "new") if e.get("data-layer") == "5"] == [99]
    assert "positions before 44 not drawn" in svg


# ------------------------------------------------------------------------------ block tables
def test_block_table_picture_follows_the_pool():
    allocator = BlockAllocator(12, 4)
    system = list(range(1, 9))  # two full blocks, shared by prefix caching
    tables = {
        "A": allocator.allocate(system + [100, 101, 102])[0],
        "B": allocator.allocate(system + [200, 201, 202, 203, 204])[0],
    }
    svg = pictures.block_table_picture(allocator, tables).svg
    shared = {int(e.get("data-block")) for e in find_by_class(svg, "shared")}
    assert shared == set(tables["A"][:2]) == set(tables["B"][:2])
    assert len(find_by_class(svg, "entry")) == sum(map(len, tables.values()))
    assert len(find_by_class(svg, "free")) == allocator.num_free
    allocator.free_sequence(tables.pop("A"))
    after = pictures.block_table_picture(allocator, tables).svg
    assert after != svg and not find_by_class(after, "shared")
    assert len(find_by_class(after, "free")) + len(find_by_class(after, "cached")) == allocator.num_free
    big = BlockAllocator(200, 4)
    big_tables = {"A": big.allocate(list(range(30)))[0]}
    drawn = [
        int(e.get("data-block")) for e in find_by_class(pictures.block_table_picture(big, big_tables).svg, "block")
    ]
    assert drawn == list(range(60))  # a big pool: the blocks from 0, past the highest one held
    with pytest.raises(ValueError, match="outside the pool"):
        pictures.block_table_picture(allocator, {"B": tables["B"] + [12]})
    with pytest.raises(ValueError, match="do not match"):
        pictures.block_table_picture(allocator, {})  # B's blocks are held by no table given


# ------------------------------------------------------------------------------ draft and verify
def test_draft_verify_picture_of_a_real_greedy_step():
    target, tokenizer = load("tiny", device="cpu")
    draft, _ = load("tiny-draft", device="cpu")
    ids = tokenizer.encode("class Stack:\n    def __init__(self):\n        self.items = []\n")
    target_cache, draft_cache = KVCache(target.config, 1, 128), KVCache(draft.config, 1, 128)
    with torch.inference_mode():
        speculative.prefill(target, target_cache, ids[:-1])
        speculative.prefill(draft, draft_cache, ids[:-1])
    greedy, k = SamplingParams(temperature=0), 4
    trace = pictures.trace_speculative_step(
        speculative.speculative_step, target, draft, target_cache, draft_cache, ids, k, greedy
    )
    # oracles: at temperature 0 the drafts are the draft's greedy tokens, the output the target's
    assert trace.drafted == list(
        stream_token_ids(draft, ids, SamplingParams(temperature=0, max_tokens=k, ignore_eos=True))
    )
    assert trace.emitted == list(
        stream_token_ids(target, ids, SamplingParams(temperature=0, max_tokens=len(trace.emitted), ignore_eos=True))
    )
    assert trace.target_cache == (len(ids) - 1, len(ids) + k, len(ids) + len(trace.emitted) - 1)
    svg = pictures.draft_verify_picture(trace, tokenizer).svg
    ET.fromstring(svg)
    proposed = [e for e in find_by_class(svg, "token") if e.get("id", "").startswith("propose-")]
    assert [e.get("data-kind") for e in proposed[1:]].count("accepted") == trace.num_accepted
    assert len(find_by_class(svg, "rolled-back")) == (
        trace.target_cache[1] - trace.target_cache[2] + trace.draft_cache[1] - trace.draft_cache[2]
    )
    too_long = dataclasses.replace(trace, emitted=trace.drafted + [1, 2])
    with pytest.raises(ValueError, match="emits"):
        pictures.draft_verify_picture(too_long)
