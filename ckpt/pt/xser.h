// xser checkpoints (NxD use_xser / NxDT save_xser / NNM save_xser): X.pt is a
// torch.save of the object tree with each tensor replaced by a
// TensorReference (torch_xla's or NeMo's; both carry `tid`), and
// X.pt.tensors/tensor_<tid>.pt holds each tensor as a plain .pt file.
#pragma once

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "ckpt/util/env.h"
#include "ckpt/pt/pt_file.h"
#include "ckpt/pt/value.h"

namespace ckpt {

// True when `path` has the xser tensor folder beside it.
bool IsXser(const std::string& path, Env* env = Env::Default());

// The folder holding the tensors of xser file `path`.
std::string XserTensorDir(const std::string& path);

// Loads an xser file with every TensorReference replaced by its tensor, each
// tensor file memory-mapped (no bytes copied). Raises ckpt::Error naming the
// file and tid for: a missing or non-tensor tensor file; a tid that is
// negative, referenced twice, or absent from `path`.info.pt when that exists;
// a tensor whose shape or dtype differs from what info.pt (NxD) or the
// reference itself (NNM) declares.
Value LoadXser(const std::string& path, const LoadOptions& opts = {}, Env* env = Env::Default());
// An ep rank's xser file under expert parallelism: the tensor folder of its
// ep_rank_00 twin, where the tensors info.pt does not mark
// expert_model_parallel lie (NxD trainer/checkpoint.py _xser_load_data:
// re.sub(r"ep_rank_\d{2}", "ep_rank_00", path) + ".tensors"; LoadXser reads
// them from there). "" for ep rank 0's file and for a name without ep.
std::string XserSharedTensorDir(const std::string& path);
// LoadXser when `path` has its tensor folder beside it, else LoadPt.
Value LoadPtOrXser(const std::string& path, const LoadOptions& opts = {}, Env* env = Env::Default());

// The xser file an X.pt.tensors folder belongs to ("" if `name` is not one).
std::string XserFileOfTensorDir(const std::string& name);

// The one reader of a tag's files, for both containers: `rel` (relative to
// `tag_dir`) as xser when its .tensors folder exists, else as plain .pt.
// Every file read must resolve inside the tag (RequireInside). What it holds
// is made plain (PlainCheckpointData): a tag file holding what shardkit would
// not write again (an os.system call, an unknown class) is refused, naming it.
Value LoadTagFile(Env* env, const std::string& tag_dir, const std::string& rel, LoadOptions opts = {});

// NxD's container rule for a tag, whose loader picks xser or plain .pt per tag
// (NxD checkpoint_storage.py is_checkpoint_xser): every X.pt.tensors folder has
// its X.pt beside it, and the tag's .pt files are all xser or all plain.
// `entries`: what model/ and optim/ hold, relative to the tag ("model/X.pt",
// "model/X.pt.tensors", ...). Returns {entry, problem} pairs, none when it holds.
struct ContainerProblem {
  std::string entry, what;
};
std::vector<ContainerProblem> XserContainerProblems(const std::set<std::string>& entries);

// The tid of a TensorReference object, or -1 if `v` is not one.
int64_t TensorReferenceId(const Value& v);
// A torch_xla.utils.serialization.TensorReference with `tid`, pickled as
// torch_xla pickles it (NEWOBJ, then BUILD with {"tid": tid}).
Value MakeTensorReference(int64_t tid);

// What an xser save of `root` as `path` consists of, as NxD writes it: `path`
// itself (the tree with each tensor replaced by a
// torch_xla.utils.serialization.TensorReference, tids numbered in
// depth-first order), `path`.tensors/tensor_<tid>.pt (one plain tensor each)
// and `path`.info.pt ({tid: {"dtype", "shape", "expert_model_parallel"}},
// what NxD's loader reads; NxD trainer/checkpoint.py
// _extract_tensor_info_and_update_state_dict).
//
// Under expert parallelism NxD marks the expert weights (modules/moe/
// moe_parallel_layers.py ExpertFusedLinear._mark_expert_parallel_weights, ep
// size > 1 only): their info.pt entry says expert_model_parallel True, and
// an ep rank above 0 writes only those tensor files (_xser_save_data: `if
// is_expert_parallel or emp_rank == 0`); its other tids are read from
// ep_rank_00's folder (_xser_load_data: non_ep_tensor_folder). `expert` says
// which top-level keys of `root` are marked (none when empty); their parts
// have `expert` set, so a writer of ep rank > 0 writes those alone.
struct XserPart {
  std::string path;
  Value value;
  bool expert = false;
};
std::vector<XserPart> SplitForXser(const std::string& path, const Value& root,
                                   const std::function<bool(const std::string& key)>& expert = {});

// How NxD deals an xser file's tensors among the `bins` data-parallel ranks
// that hold the same state (a model file's dp replicas), so each writes a
// share (NxD trainer/checkpoint.py _assign_tensors_to_bins, called by
// _xser_save_data): tensors sorted by byte size, smallest first, ties in tid
// order (Python's stable sort); each goes to the bin with the fewest bytes so
// far, the first such (list.index(min(...))). Returns the bin of each tid;
// `bytes` holds each tid's tensor bytes.
std::vector<int> XserBins(const std::vector<uint64_t>& bytes, int bins);

}  // namespace ckpt
