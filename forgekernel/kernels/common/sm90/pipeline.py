"""The producer / consumer pipelines of a warp-specialized Hopper kernel and the views of its
shared-memory storage."""

from __future__ import annotations

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait


def tma_pipeline(
    barriers, stages: int, tx_bytes, consumer_arrivals: int, cta_layout_vmnk=None
) -> pipeline.PipelineTmaAsync:
    """A `stages`-deep ring filled by TMA (one producer thread, `tx_bytes` a stage) and
    released by `consumer_arrivals` arrivals (one per consumer warp; with multicast, one per
    warp and CTA reading the stage). `barriers`: the storage's MemRange of 2 * stages Int64.
    Initialised without a sync: call `init_arrive` after the last one, `init_wait` before first
    use."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers.data_ptr(),
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_arrivals),
        tx_count=tx_bytes,
        cta_layout_vmnk=cta_layout_vmnk,
        defer_sync=True,
    )


def async_pipeline(barriers, stages: int, consumer_arrivals: int) -> pipeline.PipelineAsync:
    """A `stages`-deep ring of plain arrive / wait hand-overs (one producer thread)."""
    return pipeline.PipelineAsync.create(
        barrier_storage=barriers.data_ptr(),
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_arrivals),
        defer_sync=True,
    )


def init_arrive(cluster_shape_mn=(1, 1)) -> None:
    """After the pipelines are created: make their barrier inits visible (cluster-wide)."""
    pipeline_init_arrive(cluster_shape_mn=cluster_shape_mn, is_relaxed=True)


def init_wait(cluster_shape_mn=(1, 1)) -> None:
    """Before a pipeline's first use: every CTA of the cluster has initialised its barriers."""
    pipeline_init_wait(cluster_shape_mn=cluster_shape_mn)


def smem_tensor(field, layout) -> cute.Tensor:
    """A shared-memory storage field seen through a (swizzled) ComposedLayout."""
    return field.get_tensor(layout.outer, swizzle=layout.inner)


def producer_state(stages: int):
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)


def consumer_state(stages: int):
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
