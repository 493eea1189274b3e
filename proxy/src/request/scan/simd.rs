//! The scanner on x86-64's vector units: SSE2, which every x86-64 CPU has, and AVX2 (with
//! POPCNT and PCLMULQDQ) where the CPU reports it, for which the whole block loop is compiled
//! again so the classifier, the bit counts and the prefix XOR inline. The tests check each
//! against the plain one.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::{container_end_with, string_end_with, Classifier, Masks, ScanError};

// `{` is 0x7b and `[` 0x5b, `}` 0x7d and `]` 0x5d: OR-ing 0x20 folds each pair onto the
// brace, and no other byte lands there.

/// Whether this CPU runs the AVX2 path (the check is a cached load).
pub fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("popcnt")
        && std::arch::is_x86_feature_detected!("pclmulqdq")
}

/// SSE2, which every x86-64 CPU has.
pub struct Sse2;

impl Classifier for Sse2 {
    #[inline(always)]
    fn classify(block: &[u8; 64]) -> Masks {
        let mut m = Masks::default();
        for k in 0..4 {
            // SAFETY: SSE2 is part of x86-64; the load reads 16 bytes inside `block`.
            unsafe {
                let v = _mm_loadu_si128(block.as_ptr().add(16 * k).cast::<__m128i>());
                let folded = _mm_or_si128(v, _mm_set1_epi8(0x20));
                macro_rules! bits {
                    ($x:expr, $c:expr) => {
                        (_mm_movemask_epi8(_mm_cmpeq_epi8($x, _mm_set1_epi8($c as i8))) as u16 as u64)
                            << (16 * k)
                    };
                }
                m.quote |= bits!(v, b'"');
                m.backslash |= bits!(v, b'\\');
                m.open |= bits!(folded, b'{');
                m.close |= bits!(folded, b'}');
            }
        }
        m
    }
}

/// AVX2: only used inside the functions below, which are compiled with it enabled.
pub struct Avx2;

impl Classifier for Avx2 {
    #[inline(always)]
    fn classify(block: &[u8; 64]) -> Masks {
        let mut m = Masks::default();
        for k in 0..2 {
            // SAFETY: the load reads 32 bytes inside `block`; this is only reached from a
            // function compiled with AVX2, called where the CPU has it.
            unsafe {
                let v = _mm256_loadu_si256(block.as_ptr().add(32 * k).cast::<__m256i>());
                let folded = _mm256_or_si256(v, _mm256_set1_epi8(0x20));
                macro_rules! bits {
                    ($x:expr, $c:expr) => {
                        (_mm256_movemask_epi8(_mm256_cmpeq_epi8($x, _mm256_set1_epi8($c as i8))) as u32
                            as u64)
                            << (32 * k)
                    };
                }
                m.quote |= bits!(v, b'"');
                m.backslash |= bits!(v, b'\\');
                m.open |= bits!(folded, b'{');
                m.close |= bits!(folded, b'}');
            }
        }
        m
    }

    #[inline(always)]
    fn prefix_xor(x: u64) -> u64 {
        // SAFETY: as above; PCLMULQDQ is enabled with AVX2 here.
        unsafe {
            let product = _mm_clmulepi64_si128(_mm_set_epi64x(0, x as i64), _mm_set1_epi8(-1), 0);
            _mm_cvtsi128_si64(product) as u64
        }
    }
}

pub fn container_end_avx2(b: &[u8], at: usize) -> Result<usize, ScanError> {
    // SAFETY: callers check `has_avx2` first.
    unsafe { container_end_avx2_inner(b, at) }
}

pub fn string_end_avx2(b: &[u8], at: usize) -> Result<usize, ScanError> {
    // SAFETY: callers check `has_avx2` first.
    unsafe { string_end_avx2_inner(b, at) }
}

#[target_feature(enable = "avx2,popcnt,pclmulqdq")]
unsafe fn container_end_avx2_inner(b: &[u8], at: usize) -> Result<usize, ScanError> {
    container_end_with::<Avx2>(b, at)
}

#[target_feature(enable = "avx2,popcnt,pclmulqdq")]
unsafe fn string_end_avx2_inner(b: &[u8], at: usize) -> Result<usize, ScanError> {
    string_end_with::<Avx2>(b, at)
}
