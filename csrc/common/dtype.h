// The element types the launchers take, and the one place they are mapped to CUTLASS types.
#pragma once

namespace tk {

enum class DType { kHalf, kBFloat16 };

}  // namespace tk
