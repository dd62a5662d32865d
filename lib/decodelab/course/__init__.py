"""The Jupyter side: notebook set-up (notebook), the visible tests' checks (checking), plots,
and one widget module per notebook (widgets/).

    from decodelab import course
    device = course.setup_notebook()
"""
from decodelab.course.notebook import fast_mode, load_model, setup_notebook, use_or_reference

__all__ = ["fast_mode", "load_model", "setup_notebook", "use_or_reference"]
