"""`finish_explorer` (decodelab.course.widgets.controls): the one place every explorer is wired,
laid out and drawn, so that each notebook's explorer can be driven without a browser."""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go

from decodelab.course.widgets.controls import finish_explorer


def test_finish_explorer_wires_every_valued_control_and_lays_them_above_the_figure():
    fig = go.FigureWidget()
    size, label, button = widgets.IntSlider(value=1), widgets.Dropdown(options=["a", "b"]), widgets.Button()
    redraws = []

    def redraw(*_):
        redraws.append((size.value, label.value))
        fig.layout.title.text = f"size {size.value}, {label.value}"

    box = finish_explorer(fig, {"size": size, "label": label, "sample": button}, redraw)
    assert redraws == [(1, "a")], "drawn once, with the controls' start values"
    assert fig._widget_layout["title"]["text"] == "size 1, a", "the first drawing is the FigureWidget's start state"
    size.value, label.value = 3, "b"
    assert redraws[1:] == [(3, "a"), (3, "b")], "each control's change redraws"
    assert box.figure is fig and box.redraw is redraw and list(box.controls) == ["size", "label", "sample"]
    column, figure = box.children
    assert list(column.children) == [size, label, button] and figure is fig


def test_finish_explorer_takes_the_explorers_own_layout():
    fig = go.Figure()  # a plain Figure: redrawn, no start state to bake
    step = widgets.IntSlider()
    header = widgets.HTML("header")
    box = finish_explorer(fig, {"step": step}, lambda *_: None, children=[header, step])
    assert list(box.children) == [header, step]
