// What shardkit reads from a checkpoint to write again, made plain: every
// pickle it writes holds only what torch.load(weights_only=True) loads (the
// writer's rule, ckpt/pt/pickle_writer.h), so content read from a checkpoint
// is checked against that rule when it is read, naming the file it came from.
//
// Containers whose meaning is known become plain dicts and lists, as NxDT's
// own save does before it writes user_content.pt (NxDT nlp_overrides.py
// NLPCheckpointIO.save_checkpoint: apply_to_collection(checkpoint,
// (DictConfig, ListConfig), OmegaConf.to_container)):
//   - omegaconf's DictConfig and ListConfig (NNM's hyper_parameters.cfg,
//     NeMo ModelPT save_hyperparameters): a dict (or list) of their
//     `_content`, each value node (omegaconf.nodes.*) its `_val`; a config
//     that is None or a string ("???", "${...}") is that value, as
//     OmegaConf.to_container(resolve=False) gives it;
//   - Lightning's AttributeDict (model.hparams): a dict of its items.
// NxD's loader and Lightning's restore read these with [] and .get() only,
// which a dict answers as the config did.
#pragma once

#include <string>

#include "ckpt/pt/value.h"

namespace ckpt {

// Returns `v` made plain as above; containers of `v` are edited in place (it
// is a tree just read). Throws ckpt::Error starting with `where` (the input
// file) and naming the key path of anything else the writer would refuse: an
// object of any other class, a global such as os.system, a malformed config.
Value PlainCheckpointData(Value v, const std::string& where);

}  // namespace ckpt
