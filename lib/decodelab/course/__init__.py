"""The Jupyter side: notebook set-up (notebook), the visible tests' checks (checking), plots,
the hint buttons (hints), the pictures (pictures), the forward pass's diagnosis (diagnosis), and one
widget module per notebook (widgets/).

    from decodelab import course
    device = course.setup_notebook()
    course.engine_map("03_kv_cache")   # the engine with notebook 03's parts highlighted
    print(course.diagnose(forward, model, input_ids))   # the first operation where yours and the library's differ
"""

from decodelab.course.hints import hint_button
from decodelab.course.notebook import fast_mode, load_model, setup_notebook, use_or_reference

__all__ = [
    "diagnose",
    "diagnose_on_failure",
    "engine_map",
    "fast_mode",
    "hint_button",
    "load_model",
    "setup_notebook",
    "use_or_reference",
]


def __getattr__(name: str):
    # engine_map and the diagnosis are loaded on first use: they import the engine or the model (and torch),
    # which `from decodelab import course` must not do before setup_notebook has quietened the libraries.
    if name == "engine_map":
        from decodelab.course.pictures import engine_map

        return engine_map
    if name in ("diagnose", "diagnose_on_failure"):
        from decodelab.course import diagnosis

        return getattr(diagnosis, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
