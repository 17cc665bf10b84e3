"""One bar plot per side-by-side figure: pilot-agent beside meshagent, same run.

Usage: python3 plot_bars.py RUN.json OUT_DIR  (PYTHONPATH holding matplotlib: `make plotpeers`).
RUN.json is what a side-by-side benchmark writes: {"run", "load", "date", "figures": [{"slug",
"title", "unit", "pilot", "mesh", "goal", "floor"}]}, "floor" being null or {"what", "value"}: the
same work with no agent in the way, drawn as a third bar. Writes OUT_DIR/<slug>.png. Uses matplotlib's
bundled DejaVu font, so no system fonts are needed.
"""

import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label(v):
    """A bar's value as written in the tables: thousands grouped, no exponent."""
    if math.isnan(v):
        return "n/a"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


def main():
    data_path, out_dir = sys.argv[1], sys.argv[2]
    with open(data_path) as f:
        doc = json.load(f)
    for fig in doc["figures"]:
        pilot, mesh = fig["pilot"], fig["mesh"]
        ratio = mesh / pilot if pilot and not math.isnan(pilot) else float("nan")
        names, values, colors = ["pilot-agent", "meshagent"], [pilot, mesh], ["#7f8c8d", "#2e86c1"]
        floor = fig.get("floor")
        note = ""
        if floor:
            names.append("floor")
            values.append(floor["value"])
            colors.append("#27ae60")
            best = floor["value"] / pilot if pilot else float("nan")
            note = f"\nfloor: {floor['what']}; best possible ratio {best:.3f}"
        f, ax = plt.subplots(figsize=(5.2, 3.6 if floor else 3.4), dpi=100)
        bars = ax.bar(names, values, color=colors)
        for b, v in zip(bars, values):
            ax.annotate(label(v), (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=9)
        ax.set_ylabel(fig["unit"])
        ax.set_title(fig["title"], fontsize=9)
        ax.margins(y=0.15)
        f.text(0.5, 0.01,
               f"meshagent / pilot-agent = {ratio:.3f} (goal {fig['goal']}); "
               f"{doc['date']}, load {doc['load']}{note}",
               ha="center", fontsize=7)
        f.tight_layout(rect=(0, 0.08 if floor else 0.04, 1, 1))
        f.savefig(os.path.join(out_dir, fig["slug"] + ".png"))
        plt.close(f)


if __name__ == "__main__":
    main()
