"""Load-time rewrites of an edgespec OpenVINO IR (the model object, in place; never the file).

- `make_stateful`: the past KV inputs become OpenVINO variables (for the benchmarks: OpenVINO's
  state as a KV holder, tests/ov_state_kv.py, and GenAI's stateful IR).
- `pad_keys`: the key axis of every attention is padded with masked zero keys to a
  multiple of BLOCK, so that a query row's result does not depend on how many masked columns
  follow its keys.
- `pad_queries`: every attention gets one query row more (a copy of the last, dropped after),
  so its MatMuls never run one row. With both, a k-token verify rounds exactly like k one-token
  decodes, and a decode still runs its FullyConnecteds, nearly all of its cost, on one row.
- `window_keys`: a sliding-window layer's past may be bound shorter than the others (the keys its
  window can see, from an aligned start on): its mask keeps only those columns, so its attention
  costs the same at every context length (runtimes/openvino/kv.py binds it; docs/long-context.md).
- `repacked_bytes`: what a second compiled copy of the model adds (runtimes/openvino/runtime.py, wide).
- `cut_head` / `head_model`: the IR split at the final hidden state (the rows `logits_index`
  picks), into a body that returns those hidden rows and a head that maps hidden rows to logits
  (runtimes/shared_body.py runs a draft on the target's own body with them).

Why the padding. The CPU plugin's Softmax sums over the key axis in an order that depends on that
axis' length: on Gemma 3 270M, one query row's probabilities over the same 701 keys differ by one
ulp between 702 and 704 columns (the 704-column forward ends in 3 masked ones), and not between
any two multiples of 64. In f32 that moves logits by ~3e-5. With the plugin's dynamic int8
quantization of activations, one ulp can cross a rounding step, and the logits then move by up
to 0.5, which flips greedy near-ties.

Why the extra query row. The plugin's MatMul rounds a one-row product unlike a product of two
rows or more (measured: the scores of one query against the same keys move by ~1e-6), while its
FullyConnected kernels, compressed int4/int8 weights with dynamic quantization included, give
every row the same bits whatever the row count. Padding the forward itself to two rows would
also fix it, at a noticeable share of a decode step; padding only the attention's query costs
a fraction of that (against an unpadded forward, which is not exact; docs/LOG.md).
"""
from __future__ import annotations

import logging

import numpy as np

from ...errors import BackendError

__all__ = ["BLOCK", "HIDDEN", "cut_head", "head_model", "make_stateful", "pad_keys", "pad_queries",
           "repacked_bytes", "window_keys"]

logger = logging.getLogger(__name__)

BLOCK = 64  # the key axis is a whole number of these: Softmax then sums it in one fixed order
_NEG = np.float32(np.finfo(np.float32).min)  # the exporter's additive mask value
HIDDEN = "hidden"  # the body's output and the head's input: final hidden rows, (1, N, hidden)


def _new_kv_concats(model) -> list:
    """(name, Result, Concat) per `new_*` output: the result slices the new rows off
    Concat(past, new), as every edgespec IR's buffer layout does."""
    out = []
    for res in model.get_results():
        name = res.output(0).get_any_name() if res.output(0).get_names() else res.get_friendly_name()
        if name.startswith("new_"):
            concat = res.input_value(0).get_node().input_value(0).get_node()  # Slice(Concat(past, new))
            if concat.get_type_name() != "Concat" or concat.get_input_size() != 2:
                raise BackendError("this OpenVINO IR lacks edgespec's KV layout (export the bundle again)")
            out.append((name, res, concat))
    return out


def make_stateful(model) -> None:
    """Turn an edgespec IR's past inputs into OpenVINO variables, in place: each `new_*` output
    (the new rows sliced off Concat(past, new)) is replaced by the whole Concat, which becomes the
    variable's next value."""
    import openvino.opset13 as ops
    from openvino._offline_transformations import apply_make_stateful_transformation

    pairs = []
    for name, res, concat in _new_kv_concats(model):
        kind, j = name.split("_")[1:3]
        present = ops.result(concat.output(0))
        present.output(0).set_names({f"present_{kind}_{j}"})
        model.add_results([present])
        model.remove_result(res)
        pairs.append((model.input(f"past_{kind}_{j}").get_node(), present))
    apply_make_stateful_transformation(model, pairs)
    model.validate_nodes_and_infer_types()


def pad_keys(model, block: int = BLOCK) -> int:
    """Pad every attention's key axis with masked, zero keys to a multiple of `block`, in place;
    returns how many K/V caches were padded. The new rows are then taken from the projection
    itself rather than sliced off the concatenation (the same values). Not for a stateful model:
    its variables would keep the padding."""
    import openvino.opset13 as ops

    i64 = np.int64
    pairs = _new_kv_concats(model)
    if not pairs:
        return 0
    t = ops.gather(ops.shape_of(model.input("attention_mask").get_node(), "i64"), ops.constant([1], i64),
                   ops.constant(0, i64))  # past + new positions
    pad = ops.subtract(ops.multiply(ops.divide(ops.add(t, ops.constant([block - 1], i64)), ops.constant([block], i64)),
                                    ops.constant([block], i64)), t)  # (1,)
    zeros = {}
    for _, res, concat in pairs:
        past, new = concat.input_value(0), concat.input_value(1)
        res.input(0).replace_source_output(new)
        axis = concat.get_attributes()["axis"]
        key = (axis, str(new.get_partial_shape()))
        if key not in zeros:  # one zero block per cache shape, shared by the layers
            rank = new.get_partial_shape().rank.get_length()
            dims = ops.scatter_update(ops.shape_of(new, "i64"), ops.constant([axis % rank], i64), pad,
                                      ops.constant(0, i64))
            zeros[key] = ops.broadcast(ops.constant(np.float32(0)), dims)
        padded = ops.concat([past, new, zeros[key]], axis)
        concat.output(0).replace(padded.output(0))
    masks = {}
    for _, add, _ in _attentions(model):  # the additive masks
        mask = add.input_value(1)
        key = (mask.get_node().get_name(), mask.get_index())  # one padded mask per layer type
        if key not in masks:
            rank = mask.get_partial_shape().rank.get_length()
            masks[key] = ops.pad(mask, ops.constant([0] * rank, i64),
                                 ops.concat([ops.constant([0] * (rank - 1), i64), pad], 0), "constant",
                                 ops.constant(_NEG))
        add.input(1).replace_source_output(masks[key].output(0))
    model.validate_nodes_and_infer_types()
    logger.debug("padded %d K/V caches and %d masks to blocks of %d", len(pairs), len(masks), block)
    return len(pairs)


def _attentions(model) -> list[tuple]:
    """(scores MatMul, mask Add, output MatMul) per attention: MatMul(q, k) -> Add(mask) ->
    Softmax -> MatMul(probs, v), as every edgespec IR writes it."""
    out = []
    for sm in model.get_ordered_ops():
        if sm.get_type_name() != "Softmax":
            continue
        add = sm.input_value(0).get_node()
        scores = add.input_value(0).get_node() if add.get_type_name() == "Add" else None
        while scores is not None and scores.get_type_name() in ("Multiply", "Tanh", "Divide"):
            scores = scores.input_value(0).get_node()  # a soft-cap, cap * tanh(scores / cap) (Gemma 2)
        users = [t.get_node() for t in sm.output(0).get_target_inputs()]
        if scores is None or scores.get_type_name() != "MatMul" or len(users) != 1 \
                or users[0].get_type_name() != "MatMul":
            raise BackendError("this OpenVINO IR lacks edgespec's attention layout (export the bundle again)")
        out.append((scores, add, users[0]))
    return out


def _past_of(scores) -> str:
    """The name of the past K input an attention's score MatMul reads its keys from, through
    Unsqueeze/Reshape/Transpose to Concat(past, new[, padding])."""
    node = scores.input_value(1).get_node()
    while node.get_type_name() in ("Unsqueeze", "Reshape", "Transpose", "Convert"):
        node = node.input_value(0).get_node()
    past = node.input_value(0).get_node() if node.get_type_name() == "Concat" else None
    if past is None or past.get_type_name() != "Parameter":
        raise BackendError("this OpenVINO IR lacks edgespec's attention layout (export the bundle again)")
    return past.get_friendly_name()


def window_keys(model, layers: frozenset[int]) -> int:
    """Let the past K/V of `layers` (j of past_key_<j>) be bound shorter than a full-attention
    layer's, in place: such a past holds the last positions only, from kv_start = P - its length
    on (P: a full layer's past), and those layers' masks keep the columns from kv_start on.
    Returns how many attentions read a windowed past. A caller that binds every past whole gets
    the same model (kv_start 0). Run after `pad_keys`: the padding stays at the end, and keys and
    mask keep one length as long as kv_start is a multiple of its block."""
    import openvino.opset13 as ops

    i64 = np.int64
    names = {n for p in model.inputs for n in p.get_names()}
    full = next((j for j in range(len(names)) if f"past_key_{j}" in names and j not in layers), None)
    if full is None or not layers:
        return 0
    first = min(layers)
    # the graph reads P (where the query positions start) off the first past's shape: from now on
    # a full layer's, the one whole past
    whole = model.input(f"past_key_{full}").get_node().output(0)
    for j in layers:
        for target in list(model.input(f"past_key_{j}").get_node().output(0).get_target_inputs()):
            if target.get_node().get_type_name() == "ShapeOf":
                target.replace_source_output(whole)

    def length(j: int):
        return ops.gather(ops.shape_of(model.input(f"past_key_{j}").get_node(), "i64"), ops.constant([2], i64),
                          ops.constant(0, i64))  # (1,)

    kv_start = ops.subtract(length(full), length(first))
    masks, n = {}, 0
    for scores, add, _ in _attentions(model):
        if int(_past_of(scores).rsplit("_", 1)[1]) not in layers:
            continue
        mask = add.input_value(1)
        key = (mask.get_node().get_name(), mask.get_index())  # the sliding layers share one mask
        if key not in masks:
            rank = mask.get_partial_shape().rank.get_length()
            masks[key] = ops.slice(mask, kv_start, ops.constant([np.iinfo(i64).max], i64), ops.constant([1], i64),
                                   ops.constant([rank - 1], i64))
        add.input(1).replace_source_output(masks[key].output(0))
        n += 1
    model.validate_nodes_and_infer_types()
    logger.debug("windowed the keys of %d attentions", n)
    return n


def _rows(x, start: int, stop: int, axis: int):
    """x[start:stop] along `axis` (negative bounds count from the end)."""
    import openvino.opset13 as ops

    i64 = np.int64
    return ops.slice(x, ops.constant([start], i64), ops.constant([stop], i64), ops.constant([1], i64),
                     ops.constant([axis], i64))


def _with_last_row(x, axis: int):
    """Concat(x, x's last row on `axis`) along `axis`."""
    import openvino.opset13 as ops

    return ops.concat([x, _rows(x, -1, np.iinfo(np.int64).max, axis)], axis)


def pad_queries(model) -> int:
    """Give every attention one query row more, a copy of its last, and drop that row from the
    output, in place; returns how many attentions. K and V are untouched, so nothing extra reaches
    a cache; the mask gets the same extra row unless it broadcasts over queries."""
    attentions = _attentions(model)
    masks = {}
    for scores, add, output in attentions:
        q = scores.input_value(0)
        axis = q.get_partial_shape().rank.get_length() - 2  # (..., queries, head_dim)
        scores.input(0).replace_source_output(_with_last_row(q, axis).output(0))
        mask = add.input_value(1)
        m_axis = mask.get_partial_shape().rank.get_length() - 2
        rows = mask.get_partial_shape()[m_axis]
        if not (rows.is_static and rows.get_length() == 1):
            key = (mask.get_node().get_name(), mask.get_index())  # layers of one type share a mask
            if key not in masks:
                masks[key] = _with_last_row(mask, m_axis)
            add.input(1).replace_source_output(masks[key].output(0))
        users = list(output.output(0).get_target_inputs())
        kept = _rows(output.output(0), 0, -1, output.get_output_partial_shape(0).rank.get_length() - 2)
        for user in users:
            user.replace_source_output(kept.output(0))
    model.validate_nodes_and_infer_types()
    logger.debug("padded the queries of %d attentions", len(attentions))
    return len(attentions)


def repacked_bytes(model) -> int:
    """Bytes of `model`'s weight constants that each compiled copy of it holds on its own: the CPU
    plugin repacks matrix weights per compiled model, while a table only Gathers read (an input
    embedding not tied to a head) is read in place from the one mapped file. The plugin's own
    buffers come on top (measured: a second copy of a body adds more than its matrix weights;
    docs/backend-openvino.md)."""
    return int(sum(op.get_byte_size() for op in model.get_ops()
                   if op.get_type_name() == "Constant" and not _only_gathered(op)))


def _only_gathered(node, hops: int = 4) -> bool:
    """Whether every use of `node`'s output is a Gather's table, directly or through element-wise
    decompression ops (Convert, Subtract, Multiply, Reshape)."""
    uses = list(node.output(0).get_target_inputs())
    for target in uses:
        consumer, kind = target.get_node(), target.get_node().get_type_name()
        if kind == "Gather" and target.get_index() == 0:
            continue
        if not (hops and kind in ("Convert", "Subtract", "Multiply", "Reshape") and _only_gathered(consumer, hops - 1)):
            return False
    return bool(uses)


def _head_entry(model):
    """(logits Result, Gather): the head starts where `logits_index` picks rows of the final
    hidden state, Gather(hidden, logits_index), and ends in the `logits` output."""
    index = model.input("logits_index").get_node()
    gathers = [t.get_node() for t in index.output(0).get_target_inputs() if t.get_node().get_type_name() == "Gather"]
    logits = [r for r in model.get_results() if "logits" in r.output(0).get_names()]
    if len(gathers) != 1 or len(logits) != 1:
        raise BackendError("this OpenVINO IR lacks edgespec's head layout (export the bundle again)")
    return logits[0], gathers[0]


def cut_head(model) -> None:
    """Make `model` a body, in place: the `logits` output becomes `hidden`, the final hidden rows
    that `logits_index` picks (the head's input), so a forward computes no logits."""
    import openvino.opset13 as ops

    logits, gather = _head_entry(model)
    hidden = ops.result(gather.output(0))
    hidden.output(0).set_names({HIDDEN})
    model.add_results([hidden])
    model.remove_result(logits)
    model.validate_nodes_and_infer_types()


def head_model(model):
    """A new model of `model`'s head alone: `hidden` rows (1, N, hidden) -> `logits` (1, N, V).
    It shares the weight constants with `model`, which is no longer usable afterwards."""
    import openvino as ov
    import openvino.opset13 as ops

    logits, gather = _head_entry(model)
    shape = gather.get_output_partial_shape(0)
    hidden = ops.parameter(ov.PartialShape([1, -1, shape[2]]), gather.get_output_element_type(0), name=HIDDEN)
    hidden.output(0).set_names({HIDDEN})
    for target in list(gather.output(0).get_target_inputs()):
        target.replace_source_output(hidden.output(0))
    head = ov.Model([logits], [hidden], "edgespec-head")
    head.validate_nodes_and_infer_types()
    return head
