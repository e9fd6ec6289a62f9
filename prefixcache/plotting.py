"""matplotlib, imported only when a plot is drawn: it is the optional ``bench`` extra, not a core dependency."""
from __future__ import annotations

#: The one line printed when a plot is skipped for want of matplotlib.
MISSING = "plotting needs matplotlib: pip install 'prefixcache[bench]'"


class PlottingUnavailable(ImportError):
    """matplotlib is not installed; the message says how to install it."""


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display), or :class:`PlottingUnavailable`."""
    try:
        import matplotlib
    except ImportError:
        raise PlottingUnavailable(MISSING, name="matplotlib") from None
    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    return plt
