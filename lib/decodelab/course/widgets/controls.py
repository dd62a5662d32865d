"""What every notebook's explorer shares: one style for its controls, and how it is finished.

An explorer is an ipywidgets box of sliders driving a plotly FigureWidget. The notebooks pass
in the functions to sweep (the learner's own, or the library's reference while an exercise is
unfinished), so the sliders run exactly the code the exercises build.

Each explorer returns its box with three extra attributes, so that code (and the tests) can
drive it without a browser: ``box.figure`` (the FigureWidget), ``box.controls`` (name ->
widget) and ``box.redraw()``. `finish_explorer(fig, controls, redraw)` builds that box: it
wires every control to ``redraw``, lays the controls out above the figure (or as the explorer
says) and sets the three attributes.

No explorer displays a figure into an ipywidgets.Output: under nbclient (the notebook tests,
nbgrader's autograde, the class grader) a cell that writes into an Output widget can stall for
the whole cell timeout (see `decodelab.course.widgets.tiled_attention.tiled_explorer`).
"""

from __future__ import annotations

import copy

import ipywidgets as widgets
import plotly.graph_objects as go

# Wide enough for the longest label ("speculative tokens k", "tokens per second, batch 1").
SLIDER = dict(style={"description_width": "180px"}, layout=widgets.Layout(width="500px"))


def bake_current_state(fig) -> None:
    """Make a FigureWidget's current traces and layout the state its views start from.

    A FigureWidget sends each change as a one-off message that only views already on the page
    apply; its synced start state stays what it was constructed with. When a view is created
    after the first redraw (Run All on a busy kernel renders outputs late), it would draw that
    empty start state. Call this after the first redraw, before the widget is displayed.
    """
    fig._widget_data = copy.deepcopy(fig._data)
    fig._widget_layout = copy.deepcopy(fig._layout_obj._props)


def finish_explorer(fig, controls: dict, redraw, children: list | None = None):
    """The explorer's box, finished: every control with a value redraws when it changes, the
    box holds `children` (by default the controls in a column above the figure), carries
    ``figure``, ``controls`` and ``redraw``, is drawn once, and that drawing becomes the start
    state of the FigureWidget (a plain Figure has none: it is only redrawn).

    fig: the FigureWidget (or Figure) that redraw() draws into; controls: name -> widget, in
    the order of the default column (a Button, which has no value, is kept but not observed);
    redraw: called with the change (or nothing) and redraws fig from the controls' values."""
    for control in controls.values():
        if control.has_trait("value"):
            control.observe(redraw, names="value")
    box = widgets.VBox(children if children is not None else [widgets.VBox(list(controls.values())), fig])
    box.figure, box.controls, box.redraw = fig, controls, redraw
    redraw()
    if isinstance(fig, go.FigureWidget):
        bake_current_state(fig)
    return box
