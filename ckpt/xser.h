// xser checkpoints (NxD use_xser / NxDT save_xser / NNM save_xser): X.pt is a
// torch.save of the object tree with each tensor replaced by a
// TensorReference (torch_xla's or NeMo's; both carry `tid`), and
// X.pt.tensors/tensor_<tid>.pt holds each tensor as a plain .pt file.
#pragma once

#include <string>

#include "ckpt/env.h"
#include "ckpt/pt_file.h"
#include "ckpt/value.h"

namespace ckpt {

// True when `path` has the xser tensor folder beside it.
bool IsXser(const std::string& path, Env* env = Env::Default());

// The folder holding the tensors of xser file `path`.
std::string XserTensorDir(const std::string& path);

// Loads an xser file with every TensorReference replaced by its tensor.
// Missing or malformed tensor files raise ckpt::Error naming them.
Value LoadXser(const std::string& path, const LoadOptions& opts = {}, Env* env = Env::Default());

// The tid of a TensorReference object, or -1 if `v` is not one.
int64_t TensorReferenceId(const Value& v);

}  // namespace ckpt
