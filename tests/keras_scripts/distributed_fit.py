"""Train the toy model under tf.distribute with an Inf on ONE replica only; dump per-replica state as JSON.

Run as a subprocess (tf.distribute must be configured before TensorFlow initialises):

    python distributed_fit.py mirrored OUT.json
    python distributed_fit.py mirrored-keras OUT.json  # Keras' own LossScaleOptimizer, for contrast
    python distributed_fit.py mwms OUT.json --index I --ports P0,P1   # one process per worker
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCHES = 6
POISONED = (2, 4)  # on the second replica/worker only
PER_REPLICA_BATCH = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["mirrored", "mirrored-keras", "mwms"])
    parser.add_argument("out")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--ports", default="")
    args = parser.parse_args()

    if args.mode == "mwms":
        workers = [f"127.0.0.1:{p}" for p in args.ports.split(",")]
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers},
                                              "task": {"type": "worker", "index": args.index}})

    import keras
    import numpy as np
    import tensorflow as tf

    if args.mode.startswith("mirrored"):
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()

    from keras_scripts.toy import build_model

    from lossscale_callbacks import DynamicPolicy, InMemorySink
    from lossscale_callbacks.keras import LossScaleCallback, LossScaleOptimizer

    keras.mixed_precision.set_global_policy("mixed_float16")
    policy = DynamicPolicy(initial_scale=256.0, growth_interval=2, max_scale=2048.0)
    global_batch = PER_REPLICA_BATCH * strategy.num_replicas_in_sync

    def replica_data(replica: int):
        rng = np.random.default_rng(10 + replica)
        n = BATCHES * PER_REPLICA_BATCH
        x = rng.normal(size=(n, 4)).astype("float32")
        y = x.sum(axis=1, keepdims=True).astype("float32")
        flag = np.zeros((n, 1), "float32")
        if replica == 1:
            for b in POISONED:
                flag[b * PER_REPLICA_BATCH:(b + 1) * PER_REPLICA_BATCH] = 1.0
        return x, flag, y

    with strategy.scope():
        model = build_model(seed=0)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")

    if args.mode.startswith("mirrored"):
        # Each global batch of 16 is split in order: rows 0-7 to replica 0, rows 8-15 to replica 1.
        parts = [replica_data(r) for r in range(2)]
        x = np.stack([p[0].reshape(BATCHES, PER_REPLICA_BATCH, 4) for p in parts], 1).reshape(-1, 4)
        flag = np.stack([p[1].reshape(BATCHES, PER_REPLICA_BATCH, 1) for p in parts], 1).reshape(-1, 1)
        y = np.stack([p[2].reshape(BATCHES, PER_REPLICA_BATCH, 1) for p in parts], 1).reshape(-1, 1)
        data = {"x": {"x": x, "flag": flag}, "y": y, "batch_size": global_batch}
    else:
        # Each worker reads only its own data (sharding off); only worker 1's holds the poison.
        # With sharding off, the global batch of 16 is rebatched to 8 rows per worker: step b
        # of a worker reads rows 8b..8b+7 of its own data, i.e. its batch b.
        x, flag, y = replica_data(args.index)
        dataset = tf.data.Dataset.from_tensor_slices(({"x": x, "flag": flag}, y)).batch(global_batch)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        data = dataset.with_options(options)

    records = {"states": [], "weights": []}

    class ReplicaRecorder(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            opt = self.model.optimizer
            if args.mode == "mirrored-keras":
                return self._record_weights()
            records["states"].append([
                [np.asarray(local.numpy()).item() for local in strategy.experimental_local_results(v.value)]
                for v in opt.state_variables])
            self._record_weights()

        def _record_weights(self):
            kernel = self.model.get_layer("dense_1").kernel
            values = [local.numpy() for local in strategy.experimental_local_results(kernel.value)]
            records["weights"].append([hashlib.sha1(v.tobytes()).hexdigest() for v in values])
            records.setdefault("finite_weights", []).append([bool(np.isfinite(v).all()) for v in values])

    if args.mode == "mirrored":
        sink = InMemorySink()
        model.fit(**data, epochs=1, shuffle=False, verbose=0,
                  callbacks=[LossScaleCallback(log_every=2, policy=policy, sinks=[sink], health=None),
                             ReplicaRecorder()])
        records["sink_records"] = len(sink.records)
    elif args.mode == "mirrored-keras":
        model.fit(**data, epochs=1, shuffle=False, verbose=0, callbacks=[ReplicaRecorder()])
        records["sink_records"] = None
    else:
        # Keras 3.15's fit() cannot run under MultiWorkerMirroredStrategy (it reduces the scalar
        # loss with strategy.reduce(..., axis=0)), so the workers run the custom loop a user
        # would write: scale_loss, tape.gradient, apply_gradients, inside strategy.run.
        with strategy.scope():
            optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.01), policy=policy)
            optimizer.build(model.trainable_variables)
        model.optimizer = optimizer
        # The callback works in a custom loop too, driven through Keras' CallbackList; under
        # MultiWorkerMirroredStrategy only the chief (worker 0) writes to its sinks.
        sink = InMemorySink()
        callbacks = keras.callbacks.CallbackList(
            [LossScaleCallback(log_every=2, policy=policy, sinks=[sink], health=None), ReplicaRecorder()],
            model=model)

        @tf.function
        def train_step(batch):
            def replica_step(inputs, targets):
                with tf.GradientTape() as tape:
                    pred = model(inputs, training=True)
                    loss = tf.reduce_sum(tf.square(pred - targets)) / global_batch
                    scaled = optimizer.scale_loss(loss)
                grads = tape.gradient(scaled, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=False))

            strategy.run(replica_step, args=batch)

        callbacks.on_train_begin()
        callbacks.on_epoch_begin(0)
        for step, batch in enumerate(strategy.experimental_distribute_dataset(data)):
            callbacks.on_train_batch_begin(step)
            train_step(batch)
            callbacks.on_train_batch_end(step, {})
        callbacks.on_epoch_end(0, {})
        callbacks.on_train_end()
        records["sink_records"] = len(sink.records)
    records["replicas"] = strategy.num_replicas_in_sync
    records["optimizer"] = type(model.optimizer).__name__
    with open(args.out, "w") as f:
        json.dump(records, f)


if __name__ == "__main__":
    main()
