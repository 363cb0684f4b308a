/* Paged attention's work items for bf16 queries over bf16 caches: compiled copies of
 * attend_item (wick_attend.h), a file of their own so that the library's build compiles them
 * beside the other copies. */
#include "wick_attend.h"

ATTEND_BF16_COPIES(ATTEND_DEFINE)
