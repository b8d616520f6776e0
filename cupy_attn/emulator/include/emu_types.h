// Built-in CUDA types for the emulator: dim3/uint3, vector types, __half and __nv_bfloat16.
// Conversions round to nearest even, bit-exact against NumPy float16 and ml_dtypes.bfloat16.
#pragma once
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstring>

struct uint3 { unsigned int x, y, z; };
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

#define EMU_VECTOR2(T, NAME, ALIGN)                                                   \
    struct alignas(ALIGN) NAME { T x, y; };                                           \
    inline NAME make_##NAME(T x, T y) { return NAME{x, y}; }
#define EMU_VECTOR3(T, NAME)                                                          \
    struct NAME { T x, y, z; };                                                       \
    inline NAME make_##NAME(T x, T y, T z) { return NAME{x, y, z}; }
#define EMU_VECTOR4(T, NAME, ALIGN)                                                   \
    struct alignas(ALIGN) NAME { T x, y, z, w; };                                     \
    inline NAME make_##NAME(T x, T y, T z, T w) { return NAME{x, y, z, w}; }

EMU_VECTOR2(float, float2, 8)
EMU_VECTOR3(float, float3)
EMU_VECTOR4(float, float4, 16)
EMU_VECTOR2(int, int2, 8)
EMU_VECTOR3(int, int3)
EMU_VECTOR4(int, int4, 16)
EMU_VECTOR2(unsigned int, uint2, 8)
EMU_VECTOR4(unsigned int, uint4, 16)
EMU_VECTOR2(double, double2, 16)
EMU_VECTOR2(unsigned short, ushort2, 4)
inline uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) { return uint3{x, y, z}; }

namespace emu {

inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// float -> IEEE binary16, round to nearest even; NaN keeps its sign and top payload bits and
// stays a NaN (as NumPy does).
inline uint16_t float_to_half_bits(float f) {
    uint32_t x = float_bits(f);
    uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
    uint32_t exp = (x >> 23) & 0xffu, man = x & 0x7fffffu;
    if (exp == 0xffu) {  // inf or NaN
        if (man == 0) return sign | 0x7c00u;
        uint16_t payload = static_cast<uint16_t>(man >> 13);
        return sign | 0x7c00u | (payload ? payload : 1u);
    }
    int e = static_cast<int>(exp) - 127 + 15;
    if (e >= 0x1f) return sign | 0x7c00u;  // overflow to inf
    if (e <= 0) {  // subnormal half, or zero
        if (e < -10) return sign;  // below half the smallest subnormal: rounds to zero
        man |= 0x800000u;  // implicit bit
        int shift = 14 - e;  // 24-bit significand down to the subnormal's 10-bit field
        uint32_t half_man = man >> shift;
        uint32_t rest = man & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (half_man & 1u))) half_man++;
        return sign | static_cast<uint16_t>(half_man);  // a carry into the exponent is correct
    }
    uint32_t half = (static_cast<uint32_t>(e) << 10) | (man >> 13);
    uint32_t rest = man & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) half++;  // may carry up to inf: correct
    return sign | static_cast<uint16_t>(half);
}

inline float half_bits_to_float(uint16_t h) {
    uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0) return bits_float(sign);
        float v = std::ldexp(static_cast<float>(man), -24);
        return sign ? -v : v;
    }
    return bits_float(sign | ((exp + 127 - 15) << 23) | (man << 13));
}

// float -> bfloat16, round to nearest even; NaN stays a quiet NaN with its sign.
inline uint16_t float_to_bf16_bits(float f) {
    uint32_t x = float_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return static_cast<uint16_t>(x >> 16);
}

inline float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

}  // namespace emu

// Arithmetic on __half/__nv_bfloat16 is done in float and rounded once: float's 24-bit
// significand is at least 2p + 2 bits for both formats, so this double rounding is harmless and
// +, -, *, / and fma come out correctly rounded, as the hardware's native instructions do.
#define EMU_SMALL_FLOAT(NAME, TO_BITS, FROM_BITS)                                               \
    struct alignas(2) NAME {                                                                    \
        unsigned short __x;                                                                     \
        NAME() = default;                                                                       \
        NAME(float f) : __x(::emu::TO_BITS(f)) {}                                               \
        NAME(double d) : __x(::emu::TO_BITS(static_cast<float>(d))) {}                          \
        NAME(int i) : __x(::emu::TO_BITS(static_cast<float>(i))) {}                             \
        operator float() const { return ::emu::FROM_BITS(__x); }                                \
        NAME& operator+=(NAME o) { return *this = NAME(float(*this) + float(o)); }              \
        NAME& operator-=(NAME o) { return *this = NAME(float(*this) - float(o)); }              \
        NAME& operator*=(NAME o) { return *this = NAME(float(*this) * float(o)); }              \
        NAME& operator/=(NAME o) { return *this = NAME(float(*this) / float(o)); }              \
    };                                                                                          \
    inline NAME operator+(NAME a, NAME b) { return NAME(float(a) + float(b)); }                 \
    inline NAME operator-(NAME a, NAME b) { return NAME(float(a) - float(b)); }                 \
    inline NAME operator*(NAME a, NAME b) { return NAME(float(a) * float(b)); }                 \
    inline NAME operator/(NAME a, NAME b) { return NAME(float(a) / float(b)); }                 \
    inline NAME operator-(NAME a) { NAME r = a; r.__x ^= 0x8000u; return r; }                   \
    inline bool operator==(NAME a, NAME b) { return float(a) == float(b); }                     \
    inline bool operator!=(NAME a, NAME b) { return float(a) != float(b); }                     \
    inline bool operator<(NAME a, NAME b) { return float(a) < float(b); }                       \
    inline bool operator>(NAME a, NAME b) { return float(a) > float(b); }                       \
    inline bool operator<=(NAME a, NAME b) { return float(a) <= float(b); }                     \
    inline bool operator>=(NAME a, NAME b) { return float(a) >= float(b); }

EMU_SMALL_FLOAT(__half, float_to_half_bits, half_bits_to_float)
EMU_SMALL_FLOAT(__nv_bfloat16, float_to_bf16_bits, bf16_bits_to_float)
struct alignas(4) __half2 { __half x, y; };
struct alignas(4) __nv_bfloat162 { __nv_bfloat16 x, y; };
typedef __half half;
typedef __half2 half2;
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;

// fp16 intrinsics
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return float(h); }
inline __half2 __float2half2_rn(float f) { return __half2{__half(f), __half(f)}; }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__half(a), __half(b)}; }
inline __half2 __float22half2_rn(float2 v) { return __half2{__half(v.x), __half(v.y)}; }
inline float2 __half22float2(__half2 h) { return float2{float(h.x), float(h.y)}; }
inline float __low2float(__half2 h) { return float(h.x); }
inline float __high2float(__half2 h) { return float(h.y); }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline __half2 __halves2half2(__half a, __half b) { return __half2{a, b}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) { __half h; h.__x = u; return h; }
// bf16 intrinsics
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return float(b); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return __nv_bfloat162{__nv_bfloat16(a), __nv_bfloat16(b)}; }
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __nv_bfloat162{__nv_bfloat16(v.x), __nv_bfloat16(v.y)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 b) { return float2{float(b.x), float(b.y)}; }
inline float __low2float(__nv_bfloat162 b) { return float(b.x); }
inline float __high2float(__nv_bfloat162 b) { return float(b.y); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 b; b.__x = u; return b; }
// Shared arithmetic intrinsics for both formats.
#define EMU_SMALL_FLOAT_OPS(T, T2)                                                              \
    inline T __hadd(T a, T b) { return a + b; }                                                 \
    inline T __hsub(T a, T b) { return a - b; }                                                 \
    inline T __hmul(T a, T b) { return a * b; }                                                 \
    inline T __hdiv(T a, T b) { return a / b; }                                                 \
    inline T __hneg(T a) { return -a; }                                                         \
    inline T __habs(T a) { T r = a; r.__x &= 0x7fffu; return r; }                               \
    inline T __hfma(T a, T b, T c) { return T(std::fma(float(a), float(b), float(c))); }        \
    inline T __hmax(T a, T b) { return T(std::fmax(float(a), float(b))); }                      \
    inline T __hmin(T a, T b) { return T(std::fmin(float(a), float(b))); }                      \
    inline bool __heq(T a, T b) { return a == b; }                                              \
    inline bool __hlt(T a, T b) { return a < b; }                                               \
    inline bool __hgt(T a, T b) { return a > b; }                                               \
    inline bool __hisnan(T a) { return std::isnan(float(a)); }                                  \
    inline T2 __hadd2(T2 a, T2 b) { return T2{a.x + b.x, a.y + b.y}; }                          \
    inline T2 __hsub2(T2 a, T2 b) { return T2{a.x - b.x, a.y - b.y}; }                          \
    inline T2 __hmul2(T2 a, T2 b) { return T2{a.x * b.x, a.y * b.y}; }                          \
    inline T2 __hfma2(T2 a, T2 b, T2 c) { return T2{__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)}; } \
    inline T2 __hmax2(T2 a, T2 b) { return T2{__hmax(a.x, b.x), __hmax(a.y, b.y)}; }
EMU_SMALL_FLOAT_OPS(__half, __half2)
EMU_SMALL_FLOAT_OPS(__nv_bfloat16, __nv_bfloat162)

// Bit casts and fast-math intrinsics.
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline float __expf(float x) { return std::exp(x); }
inline float __exp10f(float x) { return std::pow(10.0f, x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __powf(float x, float y) { return std::pow(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __fadd_rn(float x, float y) { return x + y; }
// Rounded toward -inf: the host's rounding mode for one add (volatile, so that the add happens
// at run time between the mode switches rather than folded or moved by the compiler).
inline float __fadd_rd(float x, float y) {
    const int mode = std::fegetround();
    std::fesetround(FE_DOWNWARD);
    volatile float sum = x;
    sum += y;
    const float result = sum;
    std::fesetround(mode);
    return result;
}
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fmaf_rn(float x, float y, float z) { return std::fma(x, y, z); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : (x == x ? x : 0.0f)); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz(static_cast<unsigned>(x)) : 32; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned int __brev(unsigned int x) {
    unsigned int r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
// CUDA's global min/max overloads.
#define EMU_MINMAX(T)                                                                           \
    inline T min(T a, T b) { return a < b ? a : b; }                                            \
    inline T max(T a, T b) { return a > b ? a : b; }
EMU_MINMAX(int)
EMU_MINMAX(unsigned int)
EMU_MINMAX(long long)
EMU_MINMAX(unsigned long long)
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
// expf, exp2f, logf, tanhf, fmaxf, ... come from <cmath> in the global namespace, as in CUDA.
