#include "libtrain/moe_layer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "ckpt/pt/pt_file.h"
#include "ckpt/pt/value.h"
#include "ckpt/util/error.h"

namespace train {
namespace {

// tests/data/upstream/nxd_moe_layer: NxD's MoE layer (NxDT's HF Mixtral
// build, tp 1, ep 1, float32) run on fixed weights and 12 tokens; README.md
// there says what ran.
class NxdMoeReference {
 public:
  explicit NxdMoeReference(const std::string& name)
      : root_(ckpt::LoadPt(std::string(SHARDKIT_TEST_DATA) + "/upstream/nxd_moe_layer/moe_" + name + ".pt")) {}

  // A float32 tensor of the given shape, as a flat vector.
  std::vector<float> Floats(const std::string& key, const std::vector<int64_t>& shape) const {
    const ckpt::Tensor& t = root_.as_dict().At(key).as_tensor();
    EXPECT_EQ(t.dtype(), ckpt::DType::kFloat32) << key;
    EXPECT_EQ(t.shape(), shape) << key;
    const ckpt::Tensor c = t.Contiguous();
    std::vector<float> v(c.numel());
    std::memcpy(v.data(), c.data(), c.nbytes());
    return v;
  }
  std::vector<int64_t> Longs(const std::string& key) const {
    const ckpt::Tensor c = root_.as_dict().At(key).as_tensor().Contiguous();
    EXPECT_EQ(c.dtype(), ckpt::DType::kInt64) << key;
    std::vector<int64_t> v(c.numel());
    std::memcpy(v.data(), c.data(), c.nbytes());
    return v;
  }
  double Scalar(const std::string& key) const { return ckpt::AsScalar(root_.as_dict().At(key)); }

 private:
  ckpt::Value root_;
};

// Tolerance. Both sides compute in float32 (u = 2^-24 per rounding) but sum
// in different orders (Eigen's blocked products against torch's MKL ones;
// NxD's dropless path adds the two chosen experts by expert index, ours by
// rank). A sum of n terms computed in two orders differs by at most
// 2 * n * u * sum|terms| (Higham's gamma_n, once per side). The longest chain
// behind any value here is the gradient of x: gate_up (H = 16 terms), down
// (I = 32), the combine (k = 2), back through down (H = 16) and gate_up
// (2I = 64), the softmax (E = 4) and router (E = 4), plus the weight
// gradients' sum over T = 12 tokens: n = 150 in all. The sums of |terms|
// exceed the largest |result| of a tensor by cancellation; allowing 8x for
// that gives |got - want| <= 2 * 150 * 8 * 2^-24 * max|want| ~ 1.4e-4 *
// max|want| per tensor. A wrong routing or drop rule changes whole token rows
// by O(max|want|), far above this.
constexpr double kRelTolerance = 2 * 150 * 8 * 0x1p-24;

void ExpectNear(const std::string& what, const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double max_want = 0, max_diff = 0;
  for (float v : want) max_want = std::max(max_want, std::fabs(double{v}));
  ASSERT_GT(max_want, 0) << what << " is all zeros in the reference";
  const double tol = kRelTolerance * max_want;
  for (size_t i = 0; i < got.size(); ++i) {
    max_diff = std::max(max_diff, std::fabs(double{got[i]} - want[i]));
    ASSERT_NEAR(got[i], want[i], tol) << what << " element " << i;
  }
  std::printf("  %-26s max |diff| %.3g (tolerance %.3g)\n", what.c_str(), max_diff, tol);
}

void CheckAgainstNxd(const std::string& name, int expected_drops) {
  const NxdMoeReference ref(name);
  const MoeShape s{12, 16, 32, 4, 2};
  const int64_t T = s.tokens, H = s.hidden, I = s.intermediate, E = s.experts;
  const MoeOptions o{ref.Scalar("capacity_factor"), true};
  const std::vector<float> router = ref.Floats("router.weight", {E, H});
  const std::vector<float> gate_up = ref.Floats("gate_up_proj.weight", {E, H, 2 * I});
  const std::vector<float> down = ref.Floats("down_proj.weight", {E, I, H});
  const std::vector<float> x = ref.Floats("input", {T, H});
  const std::vector<float> dout = ref.Floats("output_grad", {T, H});
  const float aux_coef = static_cast<float>(ref.Scalar("aux_loss_coef"));
  ASSERT_EQ(MoeExpertCapacity(s, o.capacity_factor), static_cast<int64_t>(ref.Scalar("expert_capacity")));

  const MoeWeights w{router.data(), gate_up.data(), down.data()};
  MoeActivations acts;
  std::vector<float> out(T * H);
  MoeForward(out.data(), &acts, x.data(), w, s, o);

  // Routing and dropping are exact decisions: equal, not near. kept_mask is
  // where NxD's combine weights (get_expert_affinities_masked) are nonzero.
  EXPECT_EQ(acts.expert_index, ref.Longs("expert_index"));
  const std::vector<float> kept = ref.Floats("kept_mask", {T, E});
  int drops = 0;
  for (int64_t i = 0; i < T * E; ++i) EXPECT_EQ(acts.kept[i], kept[i]) << "token " << i / E << " expert " << i % E;
  for (int64_t i = 0; i < T * s.top_k; ++i) drops += !acts.kept[i / s.top_k * E + acts.expert_index[i]];
  EXPECT_EQ(drops, expected_drops);

  // A token that lost every expert (token 9 at capacity 6) outputs exactly 0.
  for (int64_t t = 0; t < T; ++t) {
    if (std::any_of(&acts.kept[t * E], &acts.kept[(t + 1) * E], [](uint8_t k) { return k != 0; })) continue;
    for (int64_t h = 0; h < H; ++h) EXPECT_EQ(out[t * H + h], 0.0f) << "token " << t;
  }

  ExpectNear("router logits", acts.logits, ref.Floats("router_logits", {T, E}));
  ExpectNear("combine weights", acts.combine, ref.Floats("combine_weights", {T, E}));
  ExpectNear("output", out, ref.Floats("output", {T, H}));
  ExpectNear("aux loss", {MoeAuxLoss(acts, s)}, ref.Floats("aux_loss", {}));

  std::vector<float> dx(T * H), drouter(E * H, 0.0f), dgate_up(E * H * 2 * I, 0.0f), ddown(E * I * H, 0.0f);
  MoeBackward(dx.data(), {drouter.data(), dgate_up.data(), ddown.data()}, dout.data(), aux_coef, x.data(), w, acts, s,
              o);
  ExpectNear("input grad", dx, ref.Floats("input.grad", {T, H}));
  ExpectNear("router grad", drouter, ref.Floats("router.weight.grad", {E, H}));
  ExpectNear("gate_up_proj grad", dgate_up, ref.Floats("gate_up_proj.weight.grad", {E, H, 2 * I}));
  ExpectNear("down_proj grad", ddown, ref.Floats("down_proj.weight.grad", {E, I, H}));
}

// The dropless configs (capacity_factor 0.0): every choice kept.
TEST(MoeLayer, DroplessMatchesNxd) { CheckAgainstNxd("dropless", 0); }

// capacity_factor 1.0: capacity 6; token 9 loses both its experts, token 10 one.
TEST(MoeLayer, CapacityFactorDropsTokensAsNxd) { CheckAgainstNxd("capacity", 3); }

// NxD's capacity rule: full capacity at cf <= 0 or cf >= E / k, else ceil(T k cf / E) capped at T.
TEST(MoeLayer, ExpertCapacityFollowsNxd) {
  const MoeShape s{12, 16, 32, 4, 2};
  EXPECT_EQ(MoeExpertCapacity(s, 0.0), 12);
  EXPECT_EQ(MoeExpertCapacity(s, 2.0), 12);
  EXPECT_EQ(MoeExpertCapacity(s, 1.0), 6);
  EXPECT_EQ(MoeExpertCapacity(s, 0.7), 5);  // ceil(4.2)
  EXPECT_EQ(MoeExpertCapacity({3, 16, 32, 4, 2}, 1.9), 3);  // ceil(2.85) = 3 = T
}

TEST(MoeLayer, RefusesSettingsNxdRefuses) {
  const MoeOptions normalize{0.0, true};
  EXPECT_THROW(CheckMoeSettings({12, 16, 32, 4, 5}, normalize), ckpt::Error);  // top_k > experts
  EXPECT_THROW(CheckMoeSettings({12, 16, 32, 4, 0}, normalize), ckpt::Error);
  EXPECT_THROW(CheckMoeSettings({12, 16, 32, 4, 1}, normalize), ckpt::Error);  // normalizing one choice
  EXPECT_THROW(CheckMoeSettings({0, 16, 32, 4, 2}, normalize), ckpt::Error);
  EXPECT_NO_THROW(CheckMoeSettings({12, 16, 32, 4, 1}, {0.0, false}));
  EXPECT_NO_THROW(CheckMoeSettings({12, 16, 32, 4, 2}, normalize));
}

// A pipeline stage receives exactly the statistics the earlier stages summed
// (the doubles' bytes), and stats without rows arrive empty.
TEST(MoeLayer, AuxStatsTravelBitForBit) {
  MoeAuxStats stats;
  stats.experts = 3, stats.top_k = 2, stats.rows = 24;
  stats.chosen = {17, 9, 22}, stats.affinity_sum = {0.1 + 0.2, 1.0 / 3, 7.000000000000001};
  std::vector<float> message(MoeAuxStatsFloats(3) + 1, -1.0f);
  ASSERT_EQ(MoeAuxStatsFloats(3), 14);  // 7 doubles
  PackMoeAuxStats(message.data(), stats, 3);
  EXPECT_EQ(message.back(), -1.0f);  // nothing past its floats
  MoeAuxStats got;
  UnpackMoeAuxStats(&got, message.data(), 3, 2);
  EXPECT_EQ(got.experts, 3);
  EXPECT_EQ(got.top_k, 2);
  EXPECT_EQ(got.rows, 24);
  EXPECT_EQ(got.chosen, stats.chosen);
  EXPECT_EQ(got.affinity_sum, stats.affinity_sum);
  EXPECT_EQ(MoeAuxLossOf(got), MoeAuxLossOf(stats));
  PackMoeAuxStats(message.data(), MoeAuxStats{}, 3);
  UnpackMoeAuxStats(&got, message.data(), 3, 2);
  EXPECT_EQ(got.rows, 0);
  EXPECT_TRUE(got.chosen.empty());
}

}  // namespace
}  // namespace train
