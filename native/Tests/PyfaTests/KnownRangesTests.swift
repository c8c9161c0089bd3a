import XCTest
import Pyfa

/// The CUDA backend's cache of device allocation ranges: a hit needs the whole
/// [address, address + bytes) inside one range the driver reported, an insert
/// replaces the stale ranges it overlaps, and a full cache starts over.
final class KnownRangesTests: XCTestCase {
    func testContainsOnlyWholeSpansOfOneRange() {
        let r = KnownRanges()
        r.insert(1000, 100)
        r.insert(5000, 50)
        XCTAssertTrue(r.contains(1000, 100))
        XCTAssertTrue(r.contains(1050, 50))
        XCTAssertFalse(r.contains(1050, 51))
        XCTAssertFalse(r.contains(999, 1))
        XCTAssertFalse(r.contains(1100, 1))
        XCTAssertTrue(r.contains(1100, 0))
        XCTAssertTrue(r.contains(5010, 40))
        XCTAssertFalse(r.contains(2000, 1))
        XCTAssertFalse(r.contains(UInt64.max, 1))
    }

    func testInsertReplacesOverlappingRanges() {
        let r = KnownRanges()
        r.insert(1000, 100)
        r.insert(1200, 100)
        r.insert(1050, 200)  // overlaps both: they were freed, this allocation took their addresses
        XCTAssertTrue(r.contains(1050, 200))
        XCTAssertFalse(r.contains(1000, 10))
        XCTAssertFalse(r.contains(1260, 10))
        r.insert(1000, 10)   // adjacent ranges are kept
        XCTAssertTrue(r.contains(1000, 10))
        XCTAssertTrue(r.contains(1050, 200))
    }

    func testAWorkingSetLargerThanTheOldSixteenStaysKnown() {
        let r = KnownRanges()
        for i in 0..<300 { r.insert(UInt64(i) * 4096 + 4096, 4096) }
        for i in 0..<300 { XCTAssertTrue(r.contains(UInt64(i) * 4096 + 4096, 4096), "range \(i)") }
    }

    func testAFullCacheStartsOver() {
        let r = KnownRanges(capacity: 4)
        for i in 0..<4 { r.insert(UInt64(i) * 100, 10) }
        XCTAssertTrue(r.contains(0, 10) && r.contains(300, 10))
        r.insert(1000, 10)
        XCTAssertTrue(r.contains(1000, 10))
        XCTAssertFalse(r.contains(0, 10))
        XCTAssertFalse(r.contains(300, 10))
    }

    func testAnOverflowingRangeIsIgnored() {
        let r = KnownRanges()
        r.insert(UInt64.max - 5, 10)
        XCTAssertFalse(r.contains(UInt64.max - 5, 1))
    }
}
