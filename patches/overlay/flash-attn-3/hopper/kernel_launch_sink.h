/******************************************************************************
 * A planned sparse forward's graph launch (SparseForward in flash_api_sparse.cpp, graph_launch):
 * after its first run the plan holds its kernels as one CUDA graph, and each later run builds
 * its kernels' arguments as ever (the launch templates: parameters, TMA descriptors) but hands
 * them to the sink installed for this thread, which sets them on the graph's kernel nodes,
 * instead of launching each kernel through the runtime (5-17 us a launch on a slow host).
 ******************************************************************************/

#pragma once

namespace flash {

struct KernelLaunchSink {
    // kernel: the __global__ function; argument: its one argument (the kernel's Params), valid
    // during the call only.
    virtual void take(void const *kernel, void *argument) = 0;

  protected:
    ~KernelLaunchSink() = default;
};

// Set by SparseForward around a graph run, on this thread only; null otherwise (every dense
// and eager launch).
inline thread_local KernelLaunchSink *kernel_launch_sink = nullptr;

}  // namespace flash
