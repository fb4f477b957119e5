/******************************************************************************
 * A planned sparse forward's kernels as one CUDA graph: both extensions' SparseForward with
 * graph_launch (FA-2's and FA-3's flash_api_sparse.cpp). Captured once on a private stream; each
 * later run sets every kernel node's one argument (that run's parameters, copied by the call)
 * and launches the graph once, where a direct run pays the runtime's launch per kernel (4-27 us
 * each on the hosts measured). forktools lays this file into both trees
 * (overlay.FROM_REPO); it is host code only.
 ******************************************************************************/

#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>
#include <vector>

class PlannedKernelGraph {
  public:
    // launch(stream) launches the planned kernels on `stream`, here a capturing one.
    template <typename Launch>
    explicit PlannedKernelGraph(Launch &&launch) {
        cudaStream_t capture = nullptr;
        C10_CUDA_CHECK(cudaStreamCreateWithFlags(&capture, cudaStreamNonBlocking));
        C10_CUDA_CHECK(cudaStreamBeginCapture(capture, cudaStreamCaptureModeThreadLocal));
        try {
            launch(capture);
        } catch (...) {
            cudaGraph_t partial = nullptr;
            cudaStreamEndCapture(capture, &partial);
            if (partial != nullptr) { cudaGraphDestroy(partial); }
            cudaStreamDestroy(capture);
            throw;
        }
        cudaError_t const captured = cudaStreamEndCapture(capture, &graph_);
        C10_CUDA_CHECK(cudaStreamDestroy(capture));
        C10_CUDA_CHECK(captured);
        try {
            size_t count = 0;
            C10_CUDA_CHECK(cudaGraphGetNodes(graph_, nullptr, &count));
            std::vector<cudaGraphNode_t> nodes(count);
            C10_CUDA_CHECK(cudaGraphGetNodes(graph_, nodes.data(), &count));
            for (cudaGraphNode_t node : nodes) {
                cudaGraphNodeType type;
                C10_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
                TORCH_CHECK(type == cudaGraphNodeTypeKernel, "SparseForward: its graph launch holds kernels only");
                cudaKernelNodeParams kernel{};
                C10_CUDA_CHECK(cudaGraphKernelNodeGetParams(node, &kernel));
                kernels_.emplace_back(node, kernel);
            }
            C10_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
        } catch (...) {
            cudaGraphDestroy(graph_);
            throw;
        }
    }
    PlannedKernelGraph(PlannedKernelGraph const &) = delete;
    PlannedKernelGraph &operator=(PlannedKernelGraph const &) = delete;
    ~PlannedKernelGraph() {
        if (exec_ != nullptr) { cudaGraphExecDestroy(exec_); }
        if (graph_ != nullptr) { cudaGraphDestroy(graph_); }
    }

    size_t num_kernels() const { return kernels_.size(); }

    // Sets `argument` (a pointer to the kernel's one parameter) on the nodes of `kernel`, or on
    // every node for nullptr; returns how many nodes took it.
    size_t set_argument(void const *kernel, void *argument) {
        size_t set = 0;
        for (auto &[node, params] : kernels_) {
            if (kernel != nullptr && params.func != kernel) { continue; }
            params.kernelParams = &argument;
            params.extra = nullptr;
            C10_CUDA_CHECK(cudaGraphExecKernelNodeSetParams(exec_, node, &params));
            ++set;
        }
        return set;
    }

    void launch(cudaStream_t stream) { C10_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

  private:
    cudaGraph_t graph_ = nullptr;  // kept: its nodes name those of exec_
    cudaGraphExec_t exec_ = nullptr;
    std::vector<std::pair<cudaGraphNode_t, cudaKernelNodeParams>> kernels_;
};
