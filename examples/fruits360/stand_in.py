"""A stand-in for Fruits 360, drawn procedurally (the real dataset cannot be downloaded here).

Same layout as Fruits 360: ``Training/<Class>/*.jpg`` and ``Test/<Class>/*.jpg``,
100x100 RGB images of one object on a white background.  Each class has its own
colour, shape and texture; every image gets a random rotation, scale, position
and a little colour jitter, so the task is easy but not trivial.

    python examples/fruits360/stand_in.py data/fruits360-standin   # or: created on first use
"""

import os
import shutil
import sys

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

SIZE = 100

#: name -> (RGB colour, shape, texture)
CLASSES = {
    "Apple Red": ((200, 30, 40), "round", "speckle"),
    "Banana": ((235, 210, 60), "crescent", "plain"),
    "Blueberry": ((60, 70, 160), "small_round", "plain"),
    "Cherry": ((150, 10, 40), "twin", "shine"),
    "Kiwi": ((130, 100, 50), "oval", "fuzz"),
    "Lemon": ((245, 235, 80), "lemon", "dimple"),
    "Lime": ((110, 190, 60), "round", "dimple"),
    "Orange": ((245, 140, 30), "round", "dimple"),
    "Pear": ((180, 200, 70), "pear", "speckle"),
    "Plum": ((110, 40, 110), "oval", "shine"),
    "Strawberry": ((220, 40, 60), "heart", "seeds"),
    "Watermelon": ((60, 140, 60), "big_round", "stripes"),
}


def _shape(draw, shape, cx, cy, r, colour):
    if shape in ("round", "small_round", "big_round"):
        k = {"round": 1.0, "small_round": 0.6, "big_round": 1.25}[shape]
        draw.ellipse([cx - r * k, cy - r * k, cx + r * k, cy + r * k], fill=colour)
    elif shape == "oval":
        draw.ellipse([cx - r * 1.2, cy - r * 0.8, cx + r * 1.2, cy + r * 0.8], fill=colour)
    elif shape == "lemon":
        draw.ellipse([cx - r * 1.1, cy - r * 0.8, cx + r * 1.1, cy + r * 0.8], fill=colour)
        draw.polygon([(cx - r * 1.35, cy), (cx - r * 0.9, cy - r * 0.3),
                      (cx - r * 0.9, cy + r * 0.3)], fill=colour)
        draw.polygon([(cx + r * 1.35, cy), (cx + r * 0.9, cy - r * 0.3),
                      (cx + r * 0.9, cy + r * 0.3)], fill=colour)
    elif shape == "crescent":
        draw.ellipse([cx - r * 1.3, cy - r, cx + r * 1.3, cy + r], fill=colour)
        draw.ellipse([cx - r * 1.3, cy - r * 1.5, cx + r * 1.3, cy + r * 0.4], fill=(255, 255, 255))
    elif shape == "twin":
        for dx in (-0.55, 0.55):
            draw.ellipse([cx + dx * r - r * 0.5, cy - r * 0.1, cx + dx * r + r * 0.5,
                          cy + r * 0.9], fill=colour)
        draw.line([(cx - 0.55 * r, cy), (cx, cy - r), (cx + 0.55 * r, cy)], fill=(60, 120, 40),
                  width=3)
    elif shape == "pear":
        draw.ellipse([cx - r, cy - r * 0.2, cx + r, cy + r * 1.1], fill=colour)
        draw.ellipse([cx - r * 0.6, cy - r * 0.9, cx + r * 0.6, cy + r * 0.3], fill=colour)
    elif shape == "heart":
        draw.polygon([(cx - r, cy - r * 0.5), (cx + r, cy - r * 0.5), (cx, cy + r * 1.1)],
                     fill=colour)
        draw.ellipse([cx - r, cy - r, cx, cy], fill=colour)
        draw.ellipse([cx, cy - r, cx + r, cy], fill=colour)
        draw.polygon([(cx - r * 0.4, cy - r * 0.9), (cx + r * 0.4, cy - r * 0.9),
                      (cx, cy - r * 0.5)], fill=(40, 140, 40))


def _texture(image, texture, colour, rng):
    draw = ImageDraw.Draw(image)
    pixels = np.asarray(image)
    inside = np.argwhere(np.abs(pixels.astype(int) - 255).sum(axis=2) > 60)
    if len(inside) == 0:
        return
    darker = tuple(max(0, c - 70) for c in colour)
    lighter = tuple(min(255, c + 80) for c in colour)
    if texture == "speckle":
        for y, x in inside[rng.choice(len(inside), 40)]:
            draw.point((x, y), fill=lighter)
    elif texture == "dimple":
        for y, x in inside[rng.choice(len(inside), 120)]:
            draw.point((x, y), fill=darker)
    elif texture == "seeds":
        for y, x in inside[rng.choice(len(inside), 30)]:
            draw.ellipse([x - 1, y - 1, x + 1, y + 1], fill=(250, 230, 120))
    elif texture == "stripes":
        for y, x in inside:
            if (x + y) // 6 % 2 == 0:
                draw.point((x, y), fill=darker)
    elif texture == "shine":
        y, x = inside[rng.integers(len(inside))]
        draw.ellipse([x - 4, y - 3, x + 4, y + 3], fill=(255, 255, 255))
    elif texture == "fuzz":
        for y, x in inside[rng.choice(len(inside), 300)]:
            draw.point((x, y), fill=darker if rng.random() < 0.5 else lighter)


def draw(class_name, rng):
    """One 100x100 RGB image of ``class_name``."""
    colour, shape, texture = CLASSES[class_name]
    colour = tuple(int(np.clip(c + rng.normal(0, 12), 0, 255)) for c in colour)
    image = Image.new("RGB", (SIZE * 2, SIZE * 2), (255, 255, 255))
    r = SIZE * 0.45 * rng.uniform(0.75, 1.15)
    cx, cy = SIZE + rng.uniform(-15, 15), SIZE + rng.uniform(-15, 15)
    _shape(ImageDraw.Draw(image), shape, cx, cy, r, colour)
    _texture(image, texture, colour, rng)
    image = image.rotate(rng.uniform(0, 360), resample=Image.BILINEAR, fillcolor=(255, 255, 255))
    image = image.resize((SIZE, SIZE), Image.BILINEAR).filter(ImageFilter.SMOOTH)
    return image


def generate(root, train_per_class=100, test_per_class=34, classes=None, seed=0):
    """Write the stand-in dataset under ``root`` (skipped if it is already complete).

    Every process of a job may call it at once, joiners too: each draws the same
    images into a directory of its own and the first to finish renames it into
    place (an atomic rename), so nobody needs to wait for another process."""
    marker = os.path.join(root, ".complete")
    if os.path.exists(marker):
        return root
    scratch = f"{root}.tmp-{os.getpid()}"
    names = list(classes or CLASSES)
    for split, count in (("Training", train_per_class), ("Test", test_per_class)):
        for k, name in enumerate(names):
            folder = os.path.join(scratch, split, name)
            os.makedirs(folder, exist_ok=True)
            rng = np.random.default_rng([seed, k, split == "Test"])
            for i in range(count):
                draw(name, rng).save(os.path.join(folder, f"{i}_100.jpg"), quality=92)
    with open(os.path.join(scratch, ".complete"), "w") as f:
        f.write(f"{len(names)} classes, {train_per_class}/{test_per_class} per class\n")
    os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)
    try:
        os.rename(scratch, root)
    except OSError:  # another process was first (or an unfinished one left root behind)
        if not os.path.exists(marker):
            shutil.rmtree(root, ignore_errors=True)
            os.rename(scratch, root)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return root


if __name__ == "__main__":
    print(generate(sys.argv[1] if len(sys.argv) > 1 else "data/fruits360-standin"))
