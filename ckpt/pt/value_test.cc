#include "ckpt/pt/value.h"

#include <gtest/gtest.h>

#include "ckpt/util/error.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {

TEST(Value, ForEachTensorVisitsDictsAndSequencesDepthFirst) {
  Value root = Value::NewDict();
  root.as_dict().Set("a", Value(testing::Arange({1})));
  root.as_dict().Set("b", Value::List({Value(int64_t{7}), Value(testing::Arange({2})), Value::List({Value(testing::Arange({3}))})}));
  root.as_dict().Set("c", Value(testing::Arange({4})));
  std::vector<int64_t> seen;
  ForEachTensor(root, [&](const Tensor& t) { seen.push_back(t.shape()[0]); });
  EXPECT_EQ(seen, (std::vector<int64_t>{1, 2, 3, 4}));
}

TEST(Value, DictEditsKeepOrderAndShareTensors) {
  Value d = Value::NewDict();
  Tensor t = Tensor::Zeros(DType::kFloat32, {4});
  d.as_dict().Set("b", Value(1));
  d.as_dict().Set("a", Value(t));
  d.as_dict().Set("c", Value("x"));
  ASSERT_TRUE(d.as_dict().Rename("a", "z"));
  ASSERT_TRUE(d.as_dict().Erase("b"));
  ASSERT_EQ(d.as_dict().items.size(), 2u);
  EXPECT_EQ(d.as_dict().items[0].first.as_str(), "z");
  EXPECT_EQ(d.as_dict().At("z").as_tensor().storage(), t.storage());  // no copy
  EXPECT_THROW(d.as_dict().At("missing"), Error);
  EXPECT_FALSE(d.as_dict().Rename("missing", "q"));
}

TEST(Value, AccessorsNameTheKindOnMismatch) {
  try {
    Value(3).as_str();
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "expected str, found int");
  }
}

TEST(Value, DeepEqualComparesContentNotIdentity) {
  Tensor a = Tensor::Zeros(DType::kFloat32, {2});
  Tensor b = Tensor::Zeros(DType::kFloat32, {2});
  EXPECT_TRUE(DeepEqual(Value::List({Value(a), Value(1.5)}), Value::List({Value(b), Value(1.5)})));
  reinterpret_cast<float*>(b.mutable_data())[1] = 1.f;
  EXPECT_FALSE(DeepEqual(Value(a), Value(b)));
  EXPECT_FALSE(DeepEqual(Value::List(), Value::Tuple()));
  EXPECT_FALSE(DeepEqual(Value(1), Value(true)));
  EXPECT_FALSE(DeepEqual(Value::NewDict(true), Value::NewDict(false)));
}

TEST(Value, AsScalarReadsNumbersAndOneElementTensors) {
  EXPECT_DOUBLE_EQ(AsScalar(Value(int64_t{7})), 7.0);
  EXPECT_DOUBLE_EQ(AsScalar(Value(2.5)), 2.5);
  Tensor f = Tensor::Zeros(DType::kFloat32, {});
  *reinterpret_cast<float*>(f.mutable_data()) = 3.0f;
  EXPECT_DOUBLE_EQ(AsScalar(Value(f)), 3.0);
  Tensor i = Tensor::Zeros(DType::kInt64, {1});
  *reinterpret_cast<int64_t*>(i.mutable_data()) = 42;
  EXPECT_DOUBLE_EQ(AsScalar(Value(i)), 42.0);
  EXPECT_THROW(AsScalar(Value(Tensor::Zeros(DType::kFloat32, {2}))), Error);
  EXPECT_THROW(AsScalar(Value(Tensor::Zeros(DType::kFloat16, {}))), Error);
  EXPECT_THROW(AsScalar(Value("x")), Error);
}

TEST(Value, RequirePlainDataRefusesWhatTorchLoadWouldCall) {
  Value ok = Value::NewDict(true);
  ok.as_dict().Set("lr", Value(0.1));
  ok.as_dict().Set("betas", Value::Tuple({Value(0.9), Value(0.95)}));
  ok.as_dict().Set("w", Value(Tensor::Zeros(DType::kFloat32, {2})));
  ok.as_dict().Set("dtype", Value(Global{"torch", "bfloat16"}));
  ok.as_dict().Set("size", Value::NewSeq(SeqKind::kTorchSize, {Value(2)}));
  EXPECT_NO_THROW(RequirePlainData(ok, "x"));

  auto call = std::make_shared<Object>();
  call->cls = Global{"posix", "system"};
  call->args = std::make_shared<Value>(Value::Tuple({Value("touch /tmp/pwned")}));
  Value bad = Value::List({Value(1), ok});
  bad.as_seq().items[1].as_dict().Set("hook", Value(call));
  const std::string e = testing::ErrorOf([&] { RequirePlainData(bad, "user_content.pt"); });
  EXPECT_NE(e.find("user_content.pt at [1]['hook']"), std::string::npos) << e;
  EXPECT_NE(e.find("posix.system"), std::string::npos) << e;
  EXPECT_THROW(RequirePlainData(Value(Global{"os", "system"}), "x"), Error);
  EXPECT_THROW(RequirePlainData(Value(Global{"torch", "load"}), "x"), Error);
}

TEST(Value, PathStringNamesTheRootAndEachStepWalked) {
  EXPECT_EQ(ValuePathString({}), "<root>");
  EXPECT_EQ(ValuePathString({"state", "0", "exp_avg"}), "/state/0/exp_avg");
}

}  // namespace ckpt
