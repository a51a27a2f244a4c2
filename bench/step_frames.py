"""How long a gradient's way is from Keras to MPI (issue 22): the library's frames on the
stack when a 2-rank ``model.fit`` step calls ``MPI_Allreduce``.

    python bench/step_frames.py            # launches the 2-rank job, prints the frames
    python bench/step_frames.py --tree T   # the same with the elastic_hvd of tree T

The worker (``--worker``, run by ``elastic-hvd-run``) wraps the core function that
calls ``Allreduce`` so that rank 0 records the stack at the first call made inside
``fit``; the wrapper's own frame is left out.  Frames count when their file is in
``elastic_hvd/`` or ``keras_callbacks/``: the frames of Keras, TensorFlow and Python in
between are the framework's, not ours.
"""

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import worker_result  # noqa: E402



def worker():
    import numpy as np
    import tensorflow as tf

    import elastic_hvd.tensorflow.keras as hvd
    from elastic_hvd.core import collectives, reducer

    root = Path(hvd.__file__).resolve().parents[3]  # the tree imported (see main)
    library = (str(root / "elastic_hvd"), str(root / "keras_callbacks"))

    hvd.init()
    seen = {}
    # The function that calls Allreduce: in reducer since issue 22's step 8, before in collectives.
    home = reducer if hasattr(reducer, "_allreduce_pieces") else collectives
    original = home._allreduce_pieces

    def recording(*args, **kwargs):
        if seen.get("fitting") and "stack" not in seen:
            seen["stack"] = traceback.extract_stack()[:-1]
        return original(*args, **kwargs)

    home._allreduce_pieces = recording
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(4),
                                 tf.keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)),
                  loss="mse")
    x, y = np.ones((16, 8), np.float32), np.ones((16, 1), np.float32)
    seen["fitting"] = True
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    if hvd.rank() == 0:
        frames = [f"{os.path.relpath(f.filename, root)}:{f.lineno} {f.name}"
                  for f in seen["stack"] if f.filename.startswith(library)]
        files = sorted({frame.split(":")[0] for frame in frames})
        print(worker_result.PREFIX + json.dumps({"frames": frames, "files": files,
                                                  "all_frames": len(seen["stack"]),
                                                  "tree": str(root)}), flush=True)


def main():
    tree = sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv else None
    run = [str(Path(sys.executable).parent / "elastic-hvd-run"), "-np", "2",
           *(["-x", f"PYTHONPATH={tree}"] if tree else []),
           sys.executable, os.path.abspath(__file__), "--worker"]
    # In the tree: a rank runs ``python -m``, which puts its working directory first.
    result = worker_result.run(run, timeout=600, cwd=tree,
                               env={**os.environ, "PYTHONPATH": tree} if tree else None)
    print("library frames from Keras's step to MPI_Allreduce (outermost first):")
    for frame in result["frames"]:
        print("  " + frame)
    print(f"step_frames ({result['tree']}): {len(result['frames'])} library frames in "
          f"{len(result['files'])} files ({', '.join(result['files'])}); "
          f"{result['all_frames']} frames in all")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        main()
