"""A picture of a plan: placements per layer block and parameter, heaviest collectives.

Drawn with Pillow (a dependency of tensorboard and torchtitan, so always
installed) rather than matplotlib, which the project does not otherwise need.
The same image goes to TensorBoard and into the HTML report.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from torchtitan_autoparallel.planner.plan.plan import Plan
from torchtitan_autoparallel.report.common import (
    fmt_bytes,
    group_blocks,
    placement_colors,
    predicted_step_us,
    time_unit,
)

TOP_COLLECTIVES = 6


@dataclass(frozen=True)
class _Layout:
    margin: int = 12
    label_w: int = 130  # block names
    cell_w: int = 118
    cell_h: int = 36
    line_h: int = 18
    bar_w: int = 360


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError):  # a Pillow built without FreeType has only the bitmap font
        return ImageFont.load_default()


def plan_image(plan: Plan) -> np.ndarray:
    """The plan as an RGB array (height, width, 3), uint8."""
    lay, font = _Layout(), _font(12)
    blocks = group_blocks(plan.parameters)
    colors = placement_colors(plan)
    heavy = sorted(plan.collectives, key=lambda c: -c.us * c.count)[:TOP_COLLECTIVES]
    widest = max((len(b.cells) for b in blocks), default=1)
    width = max(lay.margin * 2 + lay.label_w + widest * lay.cell_w, 2 * lay.margin + lay.bar_w + 420)
    grid_h = len(blocks) * (lay.cell_h + 4)
    # title (3 lines), grid, legend and the collectives' heading and bars, each after half a line
    height = lay.margin * 2 + lay.line_h * (3 + 1 + 1 + 2 + max(1, len(heavy))) + grid_h
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    y = _title(draw, plan, lay, font)
    y = _grid(draw, blocks, colors, lay, font, y)
    y = _legend(draw, colors, lay, font, y + lay.line_h // 2)
    _collectives(draw, heavy, lay, font, y + lay.line_h // 2)
    return np.asarray(image, dtype=np.uint8)


def plan_png(plan: Plan) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(plan_image(plan)).save(buf, format="PNG")
    return buf.getvalue()


def _title(draw: ImageDraw.ImageDraw, plan: Plan, lay: _Layout, font) -> int:
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.mesh["names"], plan.mesh["sizes"]))
    p = plan.predicted
    step = predicted_step_us(plan)
    unit = time_unit([step, p["compute_us"], p["comm_us"]])
    draw.text((lay.margin, lay.margin), f"plan on mesh {mesh} ({plan.solver}, {plan.status})", fill="black", font=font)
    draw.text(
        (lay.margin, lay.margin + lay.line_h),
        f"predicted step ({unit.name}) {unit(step)}: compute {unit(p['compute_us'])}, "
        f"communication {unit(p['comm_us'])}; parameters {fmt_bytes(p['param_bytes_per_device'])}/device",
        fill="black",
        font=font,
    )
    return lay.margin + lay.line_h * 3


def _grid(draw, blocks, colors, lay: _Layout, font, y: int) -> int:
    for block in blocks:
        draw.text((lay.margin, y + lay.cell_h // 3), block.name, fill="black", font=font)
        x = lay.margin + lay.label_w
        for short, cell in block.cells:
            box = (x, y, x + lay.cell_w - 4, y + lay.cell_h)
            draw.rectangle(box, fill=colors.get(cell, (255, 255, 255)), outline=(90, 90, 90))
            draw.text((x + 4, y + 2), short[:16], fill="black", font=font)
            draw.text((x + 4, y + 2 + lay.line_h - 2), cell[:16], fill="black", font=font)
            x += lay.cell_w
        y += lay.cell_h + 4
    return y


def _legend(draw, colors, lay: _Layout, font, y: int) -> int:
    x = lay.margin
    draw.text((x, y), "placement (mesh dim 0 first):", fill="black", font=font)
    x += 200
    for label, color in colors.items():
        draw.rectangle((x, y + 2, x + 12, y + 14), fill=color, outline=(90, 90, 90))
        draw.text((x + 16, y), label, fill="black", font=font)
        x += 24 + int(draw.textlength(label, font=font))
    return y + lay.line_h


def _collectives(draw, heavy, lay: _Layout, font, y: int) -> None:
    top = max((c.us * c.count for c in heavy), default=0.0)
    unit = time_unit([top])
    draw.text((lay.margin, y), f"heaviest collectives per step (count x time, {unit.name}):", fill="black", font=font)
    y += lay.line_h
    if not heavy:
        draw.text((lay.margin, y), "none: the plan communicates nothing", fill="black", font=font)
        return
    top = top or 1.0
    for rank, c in enumerate(heavy):
        total = c.us * c.count
        length = max(2, int(lay.bar_w * total / top))
        # The heaviest is red: the first place to look when the step is slow.
        fill = (214, 39, 40) if rank == 0 else (31, 119, 180)
        draw.rectangle((lay.margin, y + 3, lay.margin + length, y + lay.line_h - 3), fill=fill)
        text = f"{c.kind} {c.mesh_dim} {c.purpose}: {c.count} x {fmt_bytes(c.bytes)} = {unit(total)}"
        draw.text((lay.margin + lay.bar_w + 8, y + 1), text, fill="black", font=font)
        y += lay.line_h
