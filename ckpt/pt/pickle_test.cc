#include <gtest/gtest.h>

#include "ckpt/util/error.h"
#include "ckpt/pt/pickle_reader.h"
#include "ckpt/pt/pickle_writer.h"
#include "ckpt/pt/xser.h"

#include <set>

namespace ckpt {
namespace {

using namespace std::string_literals;

Value Load(const std::string& s, std::function<Value(const Value&)> pl = nullptr) {
  PickleSource src{"f.pt", "data.pkl", std::move(pl)};
  return Unpickle({reinterpret_cast<const uint8_t*>(s.data()), s.size()}, src);
}

std::string LoadError(const std::string& s) {
  try {
    Load(s);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Unpickle, Protocol0TextOpcodes) {
  // Python: pickle.dumps({'a': [1, 2.5, 'x', True, None], 'b': (123456789012345678901234567890,)}, protocol=0)
  const std::string p0 =
      "(dp0\nVa\np1\n(lp2\nI1\naF2.5\naVx\np3\naI01\naNasVb\np4\n(L123456789012345678901234567890L\ntp5\ns.";
  Value v = Load(p0);
  const Dict& d = v.as_dict();
  const auto& a = d.At("a").as_seq().items;
  ASSERT_EQ(a.size(), 5u);
  EXPECT_EQ(a[0].as_int(), 1);
  EXPECT_EQ(a[1].as_float(), 2.5);
  EXPECT_EQ(a[2].as_str(), "x");
  EXPECT_TRUE(a[3].as_bool());
  EXPECT_TRUE(a[4].is_none());
  const Value& big = d.At("b").as_seq().items[0];
  ASSERT_TRUE(big.is_bigint());
  // 123456789012345678901234567890 = 0x18ee90ff6c373e0ee4e3f0ad2
  EXPECT_EQ(std::get<BigInt>(big.raw()).le_bytes, std::string("\xd2\x0a\x3f\x4e\xee\xe0\x73\xc3\xf6\x0f\xe9\x8e\x01", 13));
}

TEST(Unpickle, NegativeAndBoundaryInts) {
  EXPECT_EQ(Load("\x80\x02J\xff\xff\xff\xff."s).as_int(), -1);
  EXPECT_EQ(Load("\x80\x02\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80."s).as_int(), INT64_MIN);
  EXPECT_EQ(Load("\x80\x02\x8a\x01\x80."s).as_int(), -128);
  EXPECT_EQ(Load("\x80\x02\x8a\x00."s).as_int(), 0);
  EXPECT_EQ(Load("L-42L\n."s).as_int(), -42);
}

TEST(Unpickle, Protocol4FramesMemoizeAndStackGlobal) {
  // Python: od = collections.OrderedDict(a=1); pickle.dumps([od, od], protocol=4)
  const std::string p4(
      "\x80\x04\x95\x2f\x00\x00\x00\x00\x00\x00\x00\x5d\x94\x28\x8c\x0b\x63\x6f\x6c\x6c\x65\x63\x74\x69\x6f\x6e\x73\x94"
      "\x8c\x0b\x4f\x72\x64\x65\x72\x65\x64\x44\x69\x63\x74\x94\x93\x94\x29\x52\x94\x8c\x01\x61\x94\x4b\x01\x73\x68\x04\x65\x2e",
      58);
  Value v = Load(p4);
  const auto& items = v.as_seq().items;
  ASSERT_EQ(items.size(), 2u);
  EXPECT_TRUE(items[0].as_dict().ordered);
  EXPECT_EQ(&items[0].as_dict(), &items[1].as_dict());  // memo keeps sharing
  EXPECT_EQ(items[0].as_dict().At("a").as_int(), 1);
}

TEST(Unpickle, UnknownClassesBecomeOpaqueObjects) {
  // NEWOBJ + BUILD, as protocol 2 pickles a plain class instance.
  const std::string p = "\x80\x02" "comegaconf.dictconfig\nDictConfig\nq\x00)\x81q\x01}q\x02X\x03\x00\x00\x00" "keyq\x03K\x07sb."s;
  Value v = Load(p);
  const Object& o = v.as_object();
  EXPECT_EQ(o.cls.full(), "omegaconf.dictconfig.DictConfig");
  EXPECT_EQ(o.how, Object::Build::kNewObj);
  EXPECT_EQ(o.state->as_dict().At("key").as_int(), 7);
  // It is not written back: torch.load would build it (PlainCheckpointData makes it plain first).
  std::vector<PickledStorage> st;
  EXPECT_THROW(Pickle(v, {}, &st), Error);
}

TEST(Unpickle, ErrorsNameFileRecordAndOffset) {
  EXPECT_EQ(LoadError("\x80\x02\xff"s), "f.pt: data.pkl: byte 2: unknown opcode 0xff"s);
  EXPECT_EQ(LoadError("\x80\x02" "a."s), "f.pt: data.pkl: byte 2: stack underflow"s);
  EXPECT_EQ(LoadError("\x80\x02X\x10\x00\x00\x00" "ab"s),
            "f.pt: data.pkl: byte 2: pickle is truncated (wanted 16 bytes, 2 left)");
  EXPECT_EQ(LoadError("\x80\x02h\x05."s), "f.pt: data.pkl: byte 2: memo key 5 was never stored"s);
  EXPECT_EQ(LoadError("\x80\x02K\x01K\x02."s), "f.pt: data.pkl: byte 6: STOP with 2 values on the stack"s);
  EXPECT_EQ(LoadError(""), "f.pt: data.pkl: byte 0: pickle is truncated (wanted 1 bytes, 0 left)");
  EXPECT_NE(LoadError("\x80\x02Q."s).find("stack underflow"s), std::string::npos);
  EXPECT_NE(LoadError("\x80\x02" "(K\x01Q."s).find("persistent id in a pickle that has no storages"s), std::string::npos);
}

TEST(Unpickle, HostileShapesAreRejectedNotCrashed) {
  // 100000 nested lists: deeper than any checkpoint.
  std::string deep = "\x80\x02";
  for (int i = 0; i < 100000; ++i) deep += "]";
  for (int i = 0; i < 99999; ++i) deep += "a";
  deep += ".";
  EXPECT_NE(LoadError(deep).find("nests deeper than"), std::string::npos);
  // A list that contains itself: the back-reference is cut (read as None),
  // so nothing downstream walks forever. omegaconf configs pickle such cycles.
  const Value self = Load("\x80\x02]q\x00h\x00" "a."s);
  ASSERT_EQ(self.as_seq().items.size(), 1u);
  EXPECT_TRUE(self.as_seq().items[0].is_none());
  // The same deep list abandoned mid-stream must also be torn down safely.
  std::string abandoned = deep.substr(0, deep.size() - 1) + "\xff";
  EXPECT_NE(LoadError(abandoned).find("unknown opcode"), std::string::npos);
}

TEST(Unpickle, TensorViewOutsideStorageNamesTheProblem) {
  auto storage = Storage::Allocate(16);
  auto pl = [&](const Value&) { return Value(StorageRef{DType::kFloat32, storage}); };
  // _rebuild_tensor_v2(pid, 0, (10,), (1,), False, OrderedDict())
  const std::string p = "\x80\x02" "ctorch._utils\n_rebuild_tensor_v2\n(K\x00QK\x00K\x0a\x85K\x01\x85\x89}tR."s;
  try {
    Load(p, pl);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("f.pt: data.pkl: byte"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("larger than its storage of 4 float32 elements"), std::string::npos) << e.what();
  }
}

TEST(Pickle, RoundTripKeepsKindsSharingAndStorages) {
  Tensor base = Tensor::Zeros(DType::kBFloat16, {4, 4});
  Tensor view = base.Narrow0(1, 3);
  Value shared = Value::List({Value(1), Value("s")});
  Value root = Value::NewDict(true);
  auto& d = root.as_dict();
  d.Set("t", Value(base));
  d.Set("v", Value(view));
  d.Set("l1", shared);
  d.Set("l2", shared);
  d.Set("f", Value(-0.0));
  d.Set("b", Value(Bytes{std::string("\x00\xff\x80", 3)}));
  d.Set("e", Value(Bytes{}));
  d.Set("big", Value(BigInt{std::string(20, '\x7f')}));
  d.Set("neg", Value(int64_t{-5000000000}));
  d.Set("size", Value::NewSeq(SeqKind::kTorchSize, {Value(3), Value(4)}));
  d.Set("set", Value::NewSeq(SeqKind::kSet, {Value(1)}));
  d.Set("tup", Value::Tuple({Value(1), Value(2), Value(3), Value(4)}));
  d.Set("g", Value(Global{"torch", "bfloat16"}));
  std::vector<PickledStorage> storages;
  const std::string bytes = Pickle(root, {}, &storages);
  ASSERT_EQ(storages.size(), 1u);  // the view shares its base's storage
  EXPECT_EQ(storages[0].key, "0");
  Value back = Load(bytes, [&](const Value& pid) {
    EXPECT_EQ(pid.as_seq().items[2].as_str(), "0");
    EXPECT_EQ(pid.as_seq().items[1].as_global().name, "BFloat16Storage");
    return Value(StorageRef{DType::kBFloat16, storages[0].storage});
  });
  EXPECT_TRUE(DeepEqual(back, root));
  EXPECT_EQ(&back.as_dict().At("l1").as_seq(), &back.as_dict().At("l2").as_seq());
  EXPECT_EQ(back.as_dict().At("v").as_tensor().storage_offset(), 4);
}

TEST(PickleWriter, ManyTorchSizesAndSetsStayDistinct) {
  // Each torch.Size pickles through a temporary tuple; the memo must never
  // mistake a later temporary (at a reused address) for an earlier one.
  Value root = Value::NewDict();
  for (int64_t i = 0; i < 50; ++i) {
    root.as_dict().items.emplace_back(Value(i), Value::NewSeq(SeqKind::kTorchSize, {Value(i), Value(i + 1)}));
    root.as_dict().items.emplace_back(Value(1000 + i), Value::NewSeq(SeqKind::kSet, {Value(i)}));
  }
  std::vector<PickledStorage> storages;
  const Value back = Load(Pickle(root, {}, &storages), [](const Value&) { return Value(); });
  EXPECT_TRUE(DeepEqual(back, root));
}

TEST(Pickle, WeightsOnlyRejectsWhatTorch113CannotLoad) {
  std::vector<PickledStorage> st;
  Value d = Value::NewDict();
  d.as_dict().Set("lr", Value(0.1));
  try {
    Pickle(d, {.weights_only = true}, &st);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot pickle /lr: floats are rejected"), std::string::npos) << e.what();
  }
  auto o = std::make_shared<Object>();
  o->cls = Global{"x", "Y"};
  EXPECT_THROW(Pickle(Value(o), {.weights_only = true}, &st), Error);
  Value ok = Value::NewDict();
  ok.as_dict().Set("w", Value(Tensor::Zeros(DType::kFloat32, {2})));
  ok.as_dict().Set("n", Value(3));
  const std::string bytes = Pickle(ok, {.weights_only = true}, &st);
  EXPECT_EQ(bytes.find('G'), std::string::npos);
}

std::string PickleError(const Value& v) {
  std::vector<PickledStorage> st;
  try {
    Pickle(v, {}, &st);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

Value Obj(Global cls, Object::Build how, Value args, Value state = Value()) {
  auto o = std::make_shared<Object>();
  o->cls = std::move(cls);
  o->how = how;
  o->args = std::make_shared<Value>(std::move(args));
  if (!state.is_none()) o->state = std::make_shared<Value>(std::move(state));
  return Value(o);
}

Value At(const std::string& key, Value v) {
  Value d = Value::NewDict();
  d.as_dict().Set(key, std::move(v));
  return d;
}

// Every global the writer emits is one torch 2's weights-only unpickler
// resolves (_weights_only_unpickler.py _get_allowed_globals), or xser's
// TensorReference; everything else is refused naming its key path.
TEST(PickleWriter, WritesOnlyWhatTorch2WeightsOnlyLoads) {
  Value user = Value::NewDict();
  user.as_dict().Set("call", Obj(Global{"posix", "system"}, Object::Build::kReduce, Value::Tuple({Value("touch x")})));
  Value groups = Value::List({At("hook", user)});
  EXPECT_EQ(PickleError(At("param_groups", groups)),
            "cannot pickle /param_groups/[0]/hook/call: the global posix.system, which torch.load(weights_only=True) refuses and plain torch.load calls");
  EXPECT_NE(PickleError(At("f", Value(Global{"os", "system"}))).find("cannot pickle /f: the global os.system"), std::string::npos);
  EXPECT_NE(PickleError(At("cfg", Obj(Global{"omegaconf.dictconfig", "DictConfig"}, Object::Build::kNewObj, Value::Tuple()))).find("/cfg: the global omegaconf.dictconfig.DictConfig"),
            std::string::npos);
  EXPECT_NE(PickleError(At("fs", Value::NewSeq(SeqKind::kFrozenSet, {Value(1)}))).find("/fs: a frozenset"), std::string::npos);
  EXPECT_NE(PickleError(At("big", Value(BigInt{std::string(300, '\x11')}))).find("/big: an int this large needs LONG4"), std::string::npos);
  EXPECT_NE(PickleError(At("dt", Value(Global{"torch", "float"}))).find("torch.float,"), std::string::npos);  // an alias, not str(dtype)
  Value ex = Obj(Global{"torch", "device"}, Object::Build::kNewObjEx, Value::Tuple({Value("cpu")}));
  ex.as_object().kwargs = std::make_shared<Value>(Value::NewDict());
  EXPECT_NE(PickleError(At("d", ex)).find("NEWOBJ_EX"), std::string::npos);
  Value listy = Obj(Global{"collections", "Counter"}, Object::Build::kReduce, Value::Tuple());
  listy.as_object().list_items.push_back(Value(1));
  EXPECT_NE(PickleError(At("c", listy)).find("holds list items"), std::string::npos);

  // What torch 2 allows, and xser's reference, are written.
  Value ok = Value::NewDict(true);
  ok.as_dict().Set("dtype", Value(Global{"torch", "bfloat16"}));
  ok.as_dict().Set("device", Obj(Global{"torch", "device"}, Object::Build::kReduce, Value::Tuple({Value("cpu")})));
  ok.as_dict().Set("set", Value::NewSeq(SeqKind::kSet, {Value(1)}));
  ok.as_dict().Set("empty_bytes", Value(Bytes{}));
  ok.as_dict().Set("size", Value::NewSeq(SeqKind::kTorchSize, {Value(2)}));
  ok.as_dict().Set("ref", MakeTensorReference(3));
  ok.as_dict().Set("w", Value(Tensor::Zeros(DType::kFloat32, {2})));
  Tensor p = Tensor::Zeros(DType::kFloat32, {2});
  p.set_parameter(true);
  ok.as_dict().Set("p", Value(p));
  ok.as_dict().Set("lr", Value(0.5));
  EXPECT_EQ(PickleError(ok), "");
  std::vector<PickledStorage> st;
  const std::string bytes = Pickle(ok, {}, &st);
  // The GLOBALs in the stream ("c<module>\n<name>\n"); no bytes() or frozenset().
  const std::set<std::string> want{"collections\nOrderedDict", "torch\nbfloat16", "torch\ndevice", "__builtin__\nset",
                                   "_codecs\nencode", "torch\nSize", "torch_xla.utils.serialization\nTensorReference",
                                   "torch._utils\n_rebuild_tensor_v2", "torch\nFloatStorage", "torch._utils\n_rebuild_parameter"};
  for (const std::string& g : want) EXPECT_NE(bytes.find("c" + g + "\n"), std::string::npos) << g;
  for (const char* g : {"__builtin__\nbytes", "frozenset", "posix", "omegaconf"}) EXPECT_EQ(bytes.find(g), std::string::npos) << g;
  const Value back = Load(bytes, [&](const Value&) { return Value(StorageRef{DType::kFloat32, st[0].storage}); });
  EXPECT_TRUE(back.as_dict().At("empty_bytes").as_bytes().empty());
  EXPECT_EQ(TensorReferenceId(back.as_dict().At("ref")), 3);
}

TEST(PickleWriter, TorchLoadableGlobalIsTorch2sList) {
  for (const Global& g : {Global{"collections", "OrderedDict"}, Global{"collections", "Counter"}, Global{"torch", "Size"},
                          Global{"torch", "float32"}, Global{"torch", "BFloat16Storage"}, Global{"torch._utils", "_rebuild_tensor_v2"},
                          Global{"torch._utils", "_rebuild_parameter"}, Global{"torch.nn.parameter", "Parameter"},
                          Global{"__builtin__", "set"}, Global{"builtins", "set"}, Global{"_codecs", "encode"}, Global{"torch", "device"},
                          Global{"torch._tensor", "_rebuild_from_type_v2"}})
    EXPECT_TRUE(TorchLoadableGlobal(g)) << g.full();
  for (const Global& g : {Global{"os", "system"}, Global{"posix", "system"}, Global{"builtins", "eval"}, Global{"__builtin__", "bytes"},
                          Global{"builtins", "frozenset"}, Global{"torch", "load"}, Global{"torch", "float"}, Global{"torch._utils", "_rebuild_xla_tensor"},
                          Global{"collections", "defaultdict"}, Global{"torch_xla.utils.serialization", "TensorReference"},
                          Global{"omegaconf.dictconfig", "DictConfig"}, Global{"torch.storage", "_load_from_bytes"}})
    EXPECT_FALSE(TorchLoadableGlobal(g)) << g.full();
  EXPECT_TRUE(IsXserReferenceClass(Global{"torch_xla.utils.serialization", "TensorReference"}));
  EXPECT_FALSE(IsXserReferenceClass(Global{"interop_classes", "TensorReference"}));
}

}  // namespace
}  // namespace ckpt
