"""The Jupyter side: notebook set-up (notebook), the visible tests' checks (checking), plots,
the hint buttons (hints), and one widget module per notebook (widgets/).

    from decodelab import course
    device = course.setup_notebook()
"""
from decodelab.course.hints import hint_button
from decodelab.course.notebook import fast_mode, load_model, setup_notebook, use_or_reference

__all__ = ["fast_mode", "hint_button", "load_model", "setup_notebook", "use_or_reference"]
