"""A stand-in for Fruits 360, drawn procedurally (the real dataset cannot be downloaded here).

Same layout as Fruits 360: ``Training/<Class>/*.jpg`` and ``Test/<Class>/*.jpg``,
100x100 RGB images of one object on a white background.  Each class has its own
colour, shape and texture; every image gets a random rotation, scale, position
and a little colour jitter, so the task is easy but not trivial.

    python examples/fruits360/stand_in.py data/fruits360-standin   # or: created on first use
    python examples/fruits360/stand_in.py --full-size data/fruits360-standin-full

``--full-size`` draws it at the real training and test splits' size (131 classes,
517 + 173 images each: 67,727 + 22,663 against Fruits 360's 67,692 + 22,688): the
12 drawn kinds and their variants ("Apple Red 2": another colour and size), in
processes (``--workers``, default every CPU); per class and split 40 images are
drawn (textures by numpy) and the others are those moved, flipped and re-lit, so an
image costs ~1 ms, not ~10.  The default stand-in (12 classes, 100 + 34 each) is
drawn as before.
"""

import argparse
import fcntl
import os
import shutil
from concurrent.futures import ProcessPoolExecutor

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


#: The real dataset's size (Fruits 360, 100x100: 131 classes, 67,692 training and 22,688 test
#: images): ``generate(**FULL_SIZE)`` draws a stand-in as large.
FULL_SIZE = {"classes": 131, "train_per_class": 517, "test_per_class": 173}


def class_table(count):
    """``count`` classes: the 12 drawn kinds, then their variants ("Apple Red 2", ...):
    each variant another colour and size -> ``{name: (colour, shape, texture, scale)}``."""
    table, bases = {}, list(CLASSES.items())
    for k in range(count):
        (name, (colour, shape, texture)), variant = bases[k % len(bases)], k // len(bases)
        if variant:
            shift = np.random.default_rng([99, k]).integers(-60, 61, 3)
            colour = tuple(int(np.clip(c + d, 0, 255)) for c, d in zip(colour, shift))
            name = f"{name} {variant + 1}"
        table[name] = (colour, shape, texture, 1.0 - 0.04 * (variant % 5))
    return table


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


def _texture_fast(image, texture, colour, rng):
    """``_texture``'s look, drawn by numpy on the pixel array (``--full-size``)."""
    pixels = np.array(image)
    inside = np.argwhere(np.abs(pixels.astype(np.int16) - 255).sum(axis=2) > 60)
    if len(inside) == 0:
        return image
    darker = np.array([max(0, c - 70) for c in colour], np.uint8)
    lighter = np.array([min(255, c + 80) for c in colour], np.uint8)
    if texture == "speckle":
        y, x = inside[rng.choice(len(inside), 40)].T
        pixels[y, x] = lighter
    elif texture == "dimple":
        y, x = inside[rng.choice(len(inside), 120)].T
        pixels[y, x] = darker
    elif texture == "seeds":
        y, x = inside[rng.choice(len(inside), 30)].T
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                if abs(dy) + abs(dx) < 2:
                    pixels[np.clip(y + dy, 0, pixels.shape[0] - 1),
                           np.clip(x + dx, 0, pixels.shape[1] - 1)] = (250, 230, 120)
    elif texture == "stripes":
        y, x = inside.T
        band = (x + y) // 6 % 2 == 0
        pixels[y[band], x[band]] = darker
    elif texture == "shine":
        y, x = inside[rng.integers(len(inside))]
        ImageDraw.Draw(image).ellipse([x - 4, y - 3, x + 4, y + 3], fill=(255, 255, 255))
        return image
    elif texture == "fuzz":
        y, x = inside[rng.choice(len(inside), 300)].T
        pick = rng.random(300) < 0.5
        pixels[y[pick], x[pick]] = darker
        pixels[y[~pick], x[~pick]] = lighter
    return Image.fromarray(pixels)


def draw(class_name, rng, spec=None):
    """One 100x100 RGB image of ``class_name`` (``spec``: its ``class_table`` entry,
    for a class beyond the 12; drawn with the numpy textures)."""
    colour, shape, texture, scale = spec or (*CLASSES[class_name], 1.0)
    colour = tuple(int(np.clip(c + rng.normal(0, 12), 0, 255)) for c in colour)
    image = Image.new("RGB", (SIZE * 2, SIZE * 2), (255, 255, 255))
    r = SIZE * 0.45 * rng.uniform(0.75, 1.15) * scale
    cx, cy = SIZE + rng.uniform(-15, 15), SIZE + rng.uniform(-15, 15)
    _shape(ImageDraw.Draw(image), shape, cx, cy, r, colour)
    if spec is None:
        _texture(image, texture, colour, rng)
    else:
        image = _texture_fast(image, texture, colour, rng)
    image = image.rotate(rng.uniform(0, 360), resample=Image.BILINEAR, fillcolor=(255, 255, 255))
    image = image.resize((SIZE, SIZE), Image.BILINEAR).filter(ImageFilter.SMOOTH)
    return image


#: Drawn images per class of a ``--full-size`` stand-in; the class's other images are
#: these, moved, flipped and re-lit (numpy, ~1 ms an image instead of ~10).
DRAWN_PER_CLASS = 40


def _vary(image, rng):
    """``image`` moved by up to 8 pixels, maybe flipped, re-lit: another file's pixels."""
    pixels = np.asarray(image, dtype=np.int16)
    dy, dx = rng.integers(-8, 9, 2)
    moved = np.full_like(pixels, 255)
    src = pixels[max(0, -dy):SIZE - max(0, dy), max(0, -dx):SIZE - max(0, dx)]
    moved[max(0, dy):max(0, dy) + src.shape[0], max(0, dx):max(0, dx) + src.shape[1]] = src
    if rng.random() < 0.5:
        moved = moved[:, ::-1]
    light = rng.uniform(0.9, 1.1) * (moved < 250) + (moved >= 250)
    return Image.fromarray(np.clip(moved * light, 0, 255).astype(np.uint8))


def _draw_class(job):
    """Draw one class of one split into ``folder`` (a process of the pool runs it):
    every image drawn, or (a class beyond the 12) ``DRAWN_PER_CLASS`` drawn and varied."""
    folder, name, spec, count, rng_seed = job
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(rng_seed)
    drawn = []
    for i in range(count):
        if spec is None or i < DRAWN_PER_CLASS:
            image = draw(name, rng, spec)
            drawn.append(image)
        else:
            image = _vary(drawn[rng.integers(len(drawn))], rng)
        image.save(os.path.join(folder, f"{i}_100.jpg"), quality=92)


def generate(root, train_per_class=100, test_per_class=34, classes=None, seed=0,
             workers=None):
    """Write the stand-in dataset under ``root`` (skipped if it is already complete).

    ``classes``: names among the 12, or a count (beyond 12: variants, see
    ``class_table``); ``workers``: processes that draw (default: one, or every CPU
    for more than 12 classes).  Every process of a job may call it at once, joiners
    too: one draws (under a lock on ``root.lock``) into a directory of its own and
    renames it into place (an atomic rename); the others wait for it and find it done."""
    marker = os.path.join(root, ".complete")
    if os.path.exists(marker):
        return root
    os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)
    with open(f"{root}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(marker):
            _generate(root, train_per_class, test_per_class, classes, seed, workers)
    return root


def _generate(root, train_per_class, test_per_class, classes, seed, workers):
    scratch = f"{root}.tmp-{os.getpid()}"
    if isinstance(classes, int):
        table = class_table(classes)
    else:
        table = {name: None for name in (classes or CLASSES)}
        if len(table) > len(CLASSES):
            table = class_table(len(table))
    if isinstance(classes, int) and classes <= len(CLASSES):
        table = {name: None for name in table}  # the 12 as they always were drawn
    jobs = [(os.path.join(scratch, split, name), name, spec, count, [seed, k, split == "Test"])
            for split, count in (("Training", train_per_class), ("Test", test_per_class))
            for k, (name, spec) in enumerate(table.items())]
    workers = workers or (1 if len(table) <= len(CLASSES) else os.cpu_count() or 1)
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            list(pool.map(_draw_class, jobs))
    else:
        for job in jobs:
            _draw_class(job)
    with open(os.path.join(scratch, ".complete"), "w") as f:
        f.write(f"{len(table)} classes, {train_per_class}/{test_per_class} per class\n")
    try:
        os.rename(scratch, root)
    except OSError:  # an unfinished one left root behind
        shutil.rmtree(root, ignore_errors=True)
        os.rename(scratch, root)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root", nargs="?", default=None)
    p.add_argument("--full-size", action="store_true",
                   help="131 classes, 517 training and 173 test images each (the real size)")
    p.add_argument("--workers", type=int, default=None, help="processes that draw")
    args = p.parse_args(argv)
    root = args.root or ("data/fruits360-standin-full" if args.full_size
                         else "data/fruits360-standin")
    sizes = FULL_SIZE if args.full_size else {}
    print(generate(root, workers=args.workers, **sizes))


if __name__ == "__main__":
    main()
